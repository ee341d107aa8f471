"""Held-out evaluations on their way from the trainer to the run's files and the terminal.

Rank 0 attaches the evaluations that finished since its previous metrics row (``EvalReport``s,
defined here, Ray-free, since the local loop makes them too) to the row it records, under ``EVALS_KEY``, and the figures of the
latest one as ``eval/...`` keys, which ``metrics.jsonl``, the trackers, Ray Train's report (so Tune
can sweep on ``eval/accuracy``) and the summary see. On the driver ``split_evals`` takes the
reports off the row; ``EvalFile`` appends each to ``RUN_DIR/eval.jsonl`` (every evaluation, at the
step whose weights it scored), its samples to ``samples.jsonl`` (with ``"eval": true``) and its
figures to TensorBoard at that step; ``eval_line`` is its line on the terminal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ray_ppo.outputs.jsonl import open_rows, read_rows

EVALS_KEY = "evals"
"""Key of a metrics row that carries the evaluations finished since the previous row."""
EVAL_FILE = "eval.jsonl"


@dataclass(frozen=True)
class EvalReport:
    """One evaluation of the weights of ``step`` (``MakerWorker.evaluate``); ``error`` instead of
    figures when it failed (the run goes on; the report says why)."""

    step: int
    """The step whose weights were asked for (0: the base model)."""
    policy_version: int = 0
    """The version of the weights that answered (the push of ``step``, or a later one if it came first)."""
    maker_id: int = -1
    eval_s: float = 0.0
    """Seconds the evaluation held the maker (its generation of experience waits meanwhile)."""
    accuracy: float = 0.0
    """Share of responses whose reward is at least ``ray_ppo.makers.evaluation.CORRECT`` (with k samples: mean@k)."""
    reward_mean: float = 0.0
    pass_at_k: float = 0.0
    num_prompts: int = 0
    greedy: bool = True
    samples_per_prompt: int = 1
    samples: tuple[dict, ...] = ()
    """The first few prompts with their response and reward."""
    error: str | None = None

    def metrics(self) -> dict[str, float]:
        """The ``eval/...`` figures of a metrics row (none for a failed evaluation)."""
        if self.error is not None:
            return {}
        figures = {"eval/accuracy": self.accuracy, "eval/reward_mean": self.reward_mean,
                   "eval/step": float(self.step), "eval/policy_version": float(self.policy_version),
                   "eval/num_prompts": float(self.num_prompts), "eval/s": self.eval_s}
        if self.samples_per_prompt > 1:
            figures["eval/pass_at_k"] = self.pass_at_k
        return figures



def attach_evals(row: dict, reports: Sequence[Any]) -> dict:
    """``row`` with ``reports`` (``EvalReport``s) under ``EVALS_KEY`` and the figures of the latest
    one that succeeded as ``eval/...`` keys (``row`` itself when there are none)."""
    if not reports:
        return row
    figures = next((r.metrics() for r in reversed(reports) if r.error is None), {})
    return {**row, **figures, EVALS_KEY: [dataclasses.asdict(r) for r in reports]}


def split_evals(metrics: dict) -> tuple[dict, list[dict]]:
    """(the metrics row without its evaluations, the evaluations it carried, as dicts)."""
    if EVALS_KEY not in metrics:
        return metrics, []
    row = dict(metrics)
    return row, row.pop(EVALS_KEY) or []


def eval_line(report: dict) -> str:
    """``eval step 10 (v10): accuracy 0.420 of 100 prompts, greedy | reward 0.420 | 35 s on maker_0``."""
    where = f"maker_{report['maker_id']}" if report["maker_id"] >= 0 else "no maker"
    if report["error"] is not None:
        return f"eval step {report['step']} failed on {where}: {report['error']}"
    k = report["samples_per_prompt"]
    how = "greedy" if report["greedy"] else f"sampled k={k}, pass@{k} {report['pass_at_k']:.3f}"
    return (f"eval step {report['step']} (v{report['policy_version']}): accuracy {report['accuracy']:.3f} of "
            f"{report['num_prompts']} prompts, {how} | reward {report['reward_mean']:.3f} | "
            f"{report['eval_s']:.0f} s on {where}")


def eval_summary(reports: Sequence[dict]) -> str:
    """``eval accuracy 0.100 (step 0) -> 0.420 (step 50)`` over a run's evaluations ("" without any)."""
    done = sorted((r for r in reports if r["error"] is None), key=lambda r: r["step"])
    if not done:
        return ""
    first, last = done[0], done[-1]
    if len(done) == 1:
        return f"eval accuracy {first['accuracy']:.3f} (step {first['step']})"
    return (f"eval accuracy {first['accuracy']:.3f} (step {first['step']}) -> {last['accuracy']:.3f} "
            f"(step {last['step']})")


def read_evals(path: str | Path) -> list[dict]:
    """The evaluations of a run directory's ``eval.jsonl`` (none if it has no such file)."""
    path = Path(path) / EVAL_FILE if Path(path).is_dir() else Path(path)
    return read_rows(path) if path.exists() else []


class EvalFile:
    """Appends evaluations to ``directory/eval.jsonl`` (opened at the first one, so a run without
    evaluation leaves no file), their figures to TensorBoard at their own step, their samples to
    ``samples`` (a ``SamplesFile``). ``resume_after_step``: a resumed run first drops the
    evaluations of the steps after its checkpoint (they are redone), in one rename."""

    def __init__(self, directory: str | Path, tensorboard: Any = None, samples: Any = None,
                 resume_after_step: int | None = None):
        self.path = Path(directory) / EVAL_FILE
        self.tensorboard, self.samples = tensorboard, samples
        self.resume_after_step = resume_after_step
        self._file = None

    def write(self, reports: Sequence[dict]) -> None:
        if not reports:
            return
        if self._file is None:
            self._file = open_rows(self.path, self.resume_after_step)
        for report in reports:
            self._file.write(json.dumps(report) + "\n")
            if report["error"] is None:
                self._figures(report)
                if self.samples is not None:
                    self.samples.write([{**s, "step": report["step"], "policy_version": report["policy_version"],
                                         "eval": True} for s in report["samples"]])
        self._file.flush()

    def _figures(self, report: dict) -> None:
        if self.tensorboard is None:
            return
        tags = {"accuracy": "eval/accuracy", "reward_mean": "eval/reward_mean", "eval_s": "eval/s"}
        if report["samples_per_prompt"] > 1:
            tags["pass_at_k"] = "eval/pass_at_k"
        for key, tag in tags.items():
            self.tensorboard.add_scalar(tag, report[key], global_step=report["step"])
        self.tensorboard.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

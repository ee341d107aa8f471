"""Per-run files (the resolved config, ``metrics.jsonl``, TensorBoard events) and per-step progress."""

from __future__ import annotations

import json
import math
import numbers
import sys
from pathlib import Path
from typing import TextIO

from ray_ppo.config import Config, ConfigError
from ray_ppo.outputs.evals import EvalFile, eval_line, split_evals
from ray_ppo.outputs.jsonl import open_rows, read_rows
from ray_ppo.outputs.samples import SamplesFile, split_samples

LIVE_KEYS = (("reward_mean", "reward", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("policy_version", "v", "{:.0f}"),
             ("staleness_mean", "stale", "{:.2f}"), ("samples_per_s", "samples/s", "{:.1f}"))

STREAM_KEYS = (("maker_sequences_running", "running", "{:.0f}"), ("maker_slot_utilisation", "slots", "{:.2f}"),
               ("token_lag_mean", "lag", "{:.2f}"), ("token_lag_max", "max", "{:.0f}"),
               ("swaps_per_sequence", "swaps/seq", "{:.2f}"), ("kv_kept", "kv kept", "{:.0f}"),
               ("kv_recomputed", "kv recomputed", "{:.0f}"))
"""Streaming makers' figures (``maker.max_running`` > 0): on the live line when a row has
``maker_sequences_running``, after LIVE_KEYS, as ``running 12, slots 0.93, lag 0.41, max 2, ...``."""

PROGRESS_KEYS = ("reward_mean", "kl", "samples_per_s")
"""The LIVE_KEYS shown in the postfix of the progress bar."""

COUNT_KEYS = (("prompts_blank", "blank"), ("prompts_truncated", "truncated"), ("prompts_lost", "lost"),
              ("items_discarded", "discarded"))
"""Prompts skipped, cut or lost and items dropped so far: shown in the live line once any is non-zero."""


def counts_text(metrics: dict) -> str:
    """``blank 3, discarded 16``: the non-zero COUNT_KEYS of a row ("" if all are zero or absent)."""
    return ", ".join(f"{label} {int(metrics[key])}" for key, label in COUNT_KEYS if metrics.get(key))


def stream_text(metrics: dict) -> str:
    """``running 12, slots 0.93, lag 0.41, ...``: a streaming run's STREAM_KEYS in a row ("" for
    a run whose makers work batch by batch)."""
    if "maker_sequences_running" not in metrics:
        return ""
    return ", ".join(f"{label} {fmt.format(metrics[key])}" for key, label, fmt in STREAM_KEYS if key in metrics)


def counts_summary(rows: list[dict]) -> str:
    """``512 prompts: 3 blank, 2 truncated, 0 lost; 16 items discarded; 9 episodes ended on an environment
    fault`` from a run's rows: the prompt and item counters of a train run's last row (the local loop
    has none), and the faulted episodes of every step if any ("" when there is nothing to say)."""
    last, parts = rows[-1], []
    if "prompts_served" in last:
        n = {key: int(last.get(key) or 0) for key, _ in COUNT_KEYS}
        parts += [f"{int(last['prompts_served'])} prompts: {n['prompts_blank']} blank, {n['prompts_truncated']} "
                  f"truncated, {n['prompts_lost']} lost", f"{n['items_discarded']} items discarded"]
    if faults := round(sum(row.get("fault_count") or 0 for row in rows)):
        parts.append(f"{faults} episodes ended on an environment fault")
    return "; ".join(parts)


def fault_lines(metrics: dict) -> list[str]:
    """The lines under a step's live line for its environment faults: one per fault the row's samples
    carry (``ray_ppo.outputs.samples.pick_faults``: a few, from rank 0's items), then how many more the step had
    (``fault_count``, the whole worker group's)."""
    shown = [sample["fault"] for sample in split_samples(metrics)[1] if "fault" in sample]
    lines = [f"  episode ended on an environment fault: {fault}" for fault in shown]
    if (more := round(metrics.get("fault_count") or 0) - len(shown)) > 0:
        lines.append(f"  ... and {more} more environment faults this step (env/fault {metrics['env/fault']:.2f})")
    return lines


TENSORBOARD_MISSING = ("logging.tensorboard=true needs the tensorboard package: "
                       "pip install tensorboard or set logging.tensorboard=false")


def _jsonable(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _is_scalar(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class TensorBoardWriter:
    """Writes each numeric, finite metric of a row as a TensorBoard scalar (tag = metric key) at its ``step``."""

    def __init__(self, directory: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(TENSORBOARD_MISSING) from exc
        self._writer = SummaryWriter(log_dir=str(directory))
        self.summary_writer = self._writer  # for text summaries (samples)

    def __call__(self, metrics: dict) -> None:
        """Every figure but the ``eval/...`` ones, which ``EvalFile`` writes at the step they evaluated."""
        step = int(metrics["step"])
        for key, value in metrics.items():
            if key != "step" and not key.startswith("eval/") and _is_scalar(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _numeric(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (what trackers can plot), ``step`` excluded."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def _import_tracker(module: str, flag: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.{flag}=true needs the {module} package: pip install {module}, "
                          f"or set logging.{flag}=false") from None


class WandbWriter:
    """Every metrics row to a Weights & Biases run (``logging.wandb``)."""

    def __init__(self, cfg: Config, directory: Path):
        wandb = _import_tracker("wandb", "wandb")
        self._run = wandb.init(project=cfg.logging.project, name=cfg.name, config=cfg.to_dict(), dir=str(directory))

    def __call__(self, metrics: dict) -> None:
        self._run.log(_numeric(metrics), step=int(metrics["step"]))

    def close(self) -> None:
        self._run.finish()


class MlflowWriter:
    """Every metrics row to an MLflow run (``logging.mlflow``); the config as flattened params."""

    def __init__(self, cfg: Config, directory: Path):
        self._mlflow = _import_tracker("mlflow", "mlflow")
        self._mlflow.set_experiment(cfg.logging.project)
        self._mlflow.start_run(run_name=cfg.name)
        self._mlflow.log_params(_flatten(cfg.to_dict()))

    def __call__(self, metrics: dict) -> None:
        self._mlflow.log_metrics(_numeric(metrics), step=int(metrics["step"]))

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class RunDirectory:
    """Writes ``config.yaml`` once and appends one JSON object per step to ``metrics.jsonl``
    (a resumed run: from its first step on, see ``_open``).

    With ``tensorboard=True`` it also writes each row to TensorBoard event files in ``tensorboard/``.
    With ``resume_after_step=N`` (a resumed run) it keeps the rows of steps <= N and appends.
    With ``logging.wandb`` / ``logging.mlflow`` set in the config it also logs to those trackers.
    """

    def __init__(self, directory: str | Path, cfg: Config, tensorboard: bool = False,
                 resume_after_step: int | None = None):
        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
        self._tensorboard = TensorBoardWriter(self.path / "tensorboard") if tensorboard else None
        self._trackers = [cls(cfg, self.path) for flag, cls in (("wandb", WandbWriter), ("mlflow", MlflowWriter))
                          if getattr(cfg.logging, flag)]
        self._config_yaml, self._resume_after_step = cfg.to_yaml(), resume_after_step
        self._metrics = None
        if resume_after_step is None:  # a new run: its files at once (a run that never steps is removed whole)
            self._open()
        self._samples = SamplesFile(self.path, self._tensorboard.summary_writer if self._tensorboard else None)
        self._evals = EvalFile(self.path, self._tensorboard.summary_writer if self._tensorboard else None,
                               self._samples, resume_after_step)

    def _open(self) -> None:
        """Write ``config.yaml`` and open ``metrics.jsonl``. A resumed run does it at its first
        step, so a resume that fails before one leaves the run's record as it was."""
        (self.path / "config.yaml").write_text(self._config_yaml)
        self._metrics = open_rows(self.path / "metrics.jsonl", self._resume_after_step)

    def __call__(self, metrics: dict) -> None:
        if self._metrics is None:
            self._open()
        metrics, samples = split_samples(metrics)
        metrics, evals = split_evals(metrics)
        self._samples.write(samples)
        self._evals.write(evals)
        self._metrics.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            self._tensorboard(metrics)
        for tracker in self._trackers:
            tracker(metrics)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        self._samples.close()
        self._evals.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        for tracker in self._trackers:
            tracker.close()


class LiveLine:
    """Prints ``step 12/100 | reward 0.412 | kl 0.0031 | ...`` for each step."""

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.total_steps, self.stream = total_steps, stream

    def __call__(self, metrics: dict) -> None:
        parts = [f"step {int(metrics['step'])}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in LIVE_KEYS if key in metrics]
        parts += [stream] if (stream := stream_text(metrics)) else []
        parts += [counts] if (counts := counts_text(metrics)) else []
        print(" | ".join(parts), file=self.stream, flush=True)
        for report in split_evals(metrics)[1]:
            print(eval_line(report), file=self.stream, flush=True)
        for line in fault_lines(metrics):
            print(line, file=self.stream, flush=True)


class Progress:
    """Per-step progress: a tqdm bar on a terminal, else one LiveLine per step.

    The bar shows ``step/total`` and a postfix with reward, kl and samples/s (LIVE_KEYS formats).
    ``stream=None`` means the ``sys.stdout`` current at construction; ``bar=None`` means a bar
    if ``stream.isatty()``.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None, bar: bool | None = None):
        self.total_steps = total_steps
        self.stream = sys.stdout if stream is None else stream
        if bar is None:
            bar = self.stream.isatty()
        self._bar = _progress_bar(total_steps, self.stream) if bar else None
        self._line = None if bar else LiveLine(total_steps, self.stream)

    def __call__(self, metrics: dict) -> None:
        if self._line is not None:
            self._line(metrics)
            return
        self._bar.set_postfix_str(", ".join([
            *(f"{label} {fmt.format(metrics[key])}" for key, label, fmt in LIVE_KEYS
              if key in PROGRESS_KEYS and _is_scalar(metrics.get(key))),
            *([counts] if (counts := counts_text(metrics)) else [])]), refresh=False)
        self._bar.update(int(metrics["step"]) - self._bar.n)
        for report in split_evals(metrics)[1]:
            self._bar.write(eval_line(report), file=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _progress_bar(total_steps: int, stream: TextIO):
    from tqdm import tqdm

    return tqdm(total=total_steps, file=stream, unit="step")


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file."""
    return read_rows(path)

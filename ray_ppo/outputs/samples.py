"""What the policy writes: every ``logging.samples_every`` steps a few prompt/response/reward samples.

The trainer's rank 0 (or the local loop) decodes ``SAMPLES_PER_STEP`` of the step's items and
attaches them to the step's metrics row under ``SAMPLES_KEY``; on the driver ``SamplesFile``
appends them to ``RUN_DIR/samples.jsonl`` (one JSON object per sample) and, with TensorBoard on,
as a text summary (tag ``samples``). ``metrics.jsonl``, trackers and ``ray.train.report`` never
see the key: ``split_samples`` takes it off the row first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

SAMPLES_KEY = "samples"
"""Key of a metrics row that carries the step's samples from the trainer to the driver."""
SAMPLES_PER_STEP = 4
SAMPLES_FILE = "samples.jsonl"


def samples_due(step: int, every: int) -> bool:
    """Whether step ``step`` writes samples (``logging.samples_every``; 0 = never)."""
    return every > 0 and step % every == 0


def pick_samples(items: Sequence[Any], tokenizer, step: int, n: int = SAMPLES_PER_STEP) -> list[dict]:
    """The first ``n`` items of a step as {step, prompt, response, reward, policy_version, uid}. The
    prompt is the item's as the data gave it (``ExperienceItem.prompt``: a text, or a list of chat
    messages, which ``samples.jsonl`` holds as JSON), or its token ids decoded for an item made from
    token ids alone; the response is decoded without special tokens. The reward, a float32 score
    (``ExperienceBatch.reward``), is written as float32's shortest decimal (0.3, not 0.30000001192092896)."""
    return [{"step": step, "prompt": it.prompt if it.prompt is not None else
             tokenizer.decode(it.prompt_ids.tolist(), skip_special_tokens=True),
             "response": tokenizer.decode(it.response_ids.tolist(), skip_special_tokens=True),
             "reward": _float32(it.reward), "policy_version": int(it.policy_version), "uid": it.uid}
            for it in list(items)[:n]]


def _float32(value: float) -> float:
    """The float whose repr is the shortest decimal that reads back as ``value`` in float32."""
    return float(str(np.float32(value)))


def pick_faults(items: Sequence[Any], tokenizer, step: int, n: int = SAMPLES_PER_STEP) -> list[dict]:
    """The first ``n`` of a step's multi-turn episodes that an environment fault ended, as samples
    (``pick_samples``) with ``fault``: what went wrong, naming the prompt. Written every step that has
    one, whatever ``logging.samples_every``; the live line prints them."""
    faulted = [it for it in items if it.episode is not None and "problem" in it.episode][:n]
    return [{**sample, "fault": it.episode["problem"]}
            for it, sample in zip(faulted, pick_samples(faulted, tokenizer, step, n), strict=True)]


def step_samples(items: Sequence[Any], tokenizer, step: int, every: int) -> list[dict]:
    """What a step's metrics row carries under ``SAMPLES_KEY``: ``pick_samples`` when the step is due
    (``logging.samples_every`` = ``every``), and ``pick_faults`` every step."""
    return (pick_samples(items, tokenizer, step) if samples_due(step, every) else []) + pick_faults(items, tokenizer, step)


def split_samples(metrics: dict) -> tuple[dict, list[dict]]:
    """(the metrics row without samples, the samples it carried)."""
    if SAMPLES_KEY not in metrics:
        return metrics, []
    row = dict(metrics)
    return row, row.pop(SAMPLES_KEY) or []


def samples_markdown(samples: Sequence[dict]) -> str:
    """A Markdown table of samples (TensorBoard renders text summaries as Markdown)."""
    def cell(text: Any) -> str:
        return (text if isinstance(text, str) else json.dumps(text)).replace("|", "\\|").replace("\n", " ")
    rows = [f"| {cell(s['prompt'])} | {cell(s['response'])} | {s['reward']:.3f} |" for s in samples]
    return "\n".join(["| prompt | response | reward |", "|---|---|---|", *rows])


class SamplesFile:
    """Appends samples to ``directory/samples.jsonl`` (opened on the first samples, so a run that
    writes none leaves no file) and to a TensorBoard ``SummaryWriter`` if given."""

    def __init__(self, directory: str | Path, tensorboard: Any = None):
        self.path = Path(directory) / SAMPLES_FILE
        self.tensorboard = tensorboard
        self._file = None

    def write(self, samples: Sequence[dict]) -> None:
        if not samples:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        for sample in samples:
            self._file.write(json.dumps(sample) + "\n")
        self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.add_text(SAMPLES_KEY, samples_markdown(samples), global_step=int(samples[0]["step"]))
            self.tensorboard.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

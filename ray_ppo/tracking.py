"""Per-run files: the resolved config, ``metrics.jsonl``, and a live line per step."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO

from ray_ppo.config import Config

LIVE_KEYS = (("reward_mean", "reward", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("policy_version", "v", "{:.0f}"),
             ("staleness_mean", "stale", "{:.2f}"), ("samples_per_s", "samples/s", "{:.1f}"))


def _jsonable(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RunDirectory:
    """Writes ``config.yaml`` once and appends one JSON object per step to ``metrics.jsonl``."""

    def __init__(self, directory: str | Path, cfg: Config):
        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(cfg.to_yaml())
        self._metrics = open(self.path / "metrics.jsonl", "w")

    def __call__(self, metrics: dict) -> None:
        self._metrics.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self._metrics.close()


class LiveLine:
    """Prints ``step 12/100 | reward 0.412 | kl 0.0031 | ...`` for each step."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout):
        self.total_steps, self.stream = total_steps, stream

    def __call__(self, metrics: dict) -> None:
        parts = [f"step {int(metrics['step'])}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in LIVE_KEYS if key in metrics]
        print(" | ".join(parts), file=self.stream, flush=True)


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

"""A run directory's JSON Lines files (``metrics.jsonl``, ``eval.jsonl``): one row a line, each
with the ``step`` it belongs to."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSON Lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def open_rows(path: Path, resume_after_step: int | None) -> TextIO:
    """``path`` opened to append rows. A new run (``resume_after_step`` None) starts it empty; a
    resumed run first keeps only the rows of steps up to its checkpoint (the later ones are redone),
    replaced in one rename, so a run killed at any moment keeps its history up to the checkpoint."""
    if resume_after_step is None:
        return open(path, "w")
    if path.exists():
        kept = [row for row in read_rows(path) if row.get("step", 0) <= resume_after_step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, path)
    return open(path, "a")

"""The run directory: never clobbered, always resumable.

    RUN_DIR/config.yaml, metrics.jsonl, tensorboard/, curves.png   the run's record (appended on resume)
    RUN_DIR/checkpoints/step_<N>/                                   the kept checkpoints (trainer.keep_checkpoints)
    RUN_DIR/checkpoint -> checkpoints/step_<N>                      the latest complete one, switched atomically
    RUN_DIR/ray_train/                                              Ray Train's own storage

- ``claim_run_dir``: a new run refuses a directory that already holds files unless told to
  overwrite; an overwritten run is set aside and deleted only once the new run completes its
  first step; a run that fails before its first step leaves nothing behind (and an overwritten
  run is put back).
- ``CheckpointPublisher``: the driver publishes each checkpoint as soon as Ray Train stored it
  (not only after ``fit()`` returns), so Ctrl-C, a crash or ``kill -9`` of the driver leave
  ``RUN_DIR/checkpoint`` on the latest complete checkpoint.
- ``resume_point``: what ``--resume RUN_DIR`` continues from, with errors that say what to do;
  ``resuming_line``, the line such a run starts with.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_ppo.outputs.failures import ERROR_LOG
from ray_ppo.train.checkpoint import LINK, CheckpointError, RunState, publish_checkpoint, size_line, validate_checkpoint

if TYPE_CHECKING:
    from ray_ppo.cluster.handles import CoordinatorClient


class RunDirError(ValueError):
    """A run directory that cannot be used as asked, with what to do instead."""


@dataclass
class RunDirClaim:
    """A run directory this process writes to. ``started()`` once the run has completed a step;
    ``release()`` when the run ends: a run that never started is undone."""

    path: Path
    created: bool           # the directory did not exist before this run
    set_aside: Path | None  # the overwritten run, until this one starts
    is_started: bool = False

    def started(self, *_: Any) -> None:
        """The run completed a step: an overwritten run is gone for good. (A metrics callback.)"""
        if not self.is_started:
            self.is_started = True
            if self.set_aside is not None:
                shutil.rmtree(self.set_aside, ignore_errors=True)
                self.set_aside = None

    def release(self) -> None:
        """End of the run. One that never completed a step leaves the directory as it found it."""
        if self.is_started:
            return
        if self.created or self.set_aside is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.set_aside is not None:
            self.set_aside.rename(self.path)
            self.set_aside = None


def claim_run_dir(path: str | Path, *, resume: bool = False, overwrite: bool = False) -> RunDirClaim:
    """Take ``path`` for a run. A new run needs it absent or empty, unless ``overwrite``;
    a resumed run appends to it."""
    path = Path(path)
    if resume:
        return RunDirClaim(path, created=False, set_aside=None, is_started=True)  # nothing to undo
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file; give another --output")
    # The error log of attempts that failed before their first step is all such a directory holds.
    holds = sorted(p.name for p in path.iterdir() if p.name != ERROR_LOG) if path.is_dir() else []
    if not holds:
        path.mkdir(parents=True, exist_ok=True)
        return RunDirClaim(path, created=True, set_aside=None)
    if not overwrite:
        shown = ", ".join(holds[:4]) + (", ..." if len(holds) > 4 else "")
        resume = f"continue it with --resume {path}, " if (path / LINK).exists() else \
            "it wrote no checkpoint to continue from; "
        raise RunDirError(f"run directory {path} already holds a run ({shown}); {resume}replace it with --overwrite, "
                          f"or give another --output")
    set_aside = path.with_name(f".{path.name}.overwritten-{uuid.uuid4().hex[:8]}")
    path.rename(set_aside)
    path.mkdir()
    return RunDirClaim(path, created=True, set_aside=set_aside)


def resume_point(run_dir: str | Path) -> tuple[Path, RunState]:
    """(checkpoint directory, its run state) that ``--resume run_dir`` continues from."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"--resume {run_dir}: not a run directory (no config.yaml); give the --output of an earlier run")
    checkpoint = run_dir / LINK
    if not checkpoint.exists():
        raise RunDirError(f"--resume {run_dir}: the run wrote no checkpoint before it stopped (set "
                          f"trainer.checkpoint_every=N to checkpoint during a run); start it again with --overwrite")
    return checkpoint, validate_checkpoint(checkpoint)


def resuming_line(run_dir: str | Path, step: int, checkpoint: Path) -> str:
    """The line a resumed run starts with: the step it continues from and the checkpoint it
    holds (``RUN_DIR/checkpoint`` links to ``RUN_DIR/checkpoints/step_<N>``)."""
    target = checkpoint.parent / os.readlink(checkpoint) if checkpoint.is_symlink() else checkpoint
    return f"resuming {run_dir} from step {step} (checkpoint {target})"


def nothing_to_do(run_dir: str | Path, step: int, total_steps: int) -> str | None:
    """The line to print when a resumed run has already trained ``total_steps``, else None."""
    if step < total_steps:
        return None
    return (f"run {run_dir} has already trained {step} steps (trainer.total_steps={total_steps}): nothing to do; "
            f"to train further: ray-ppo train --resume {run_dir} trainer.total_steps={step + max(step, 1)}")


def stopped_line(command: str, run_dir: str | Path, steps_done: int | None, why: str = "interrupted") -> str:
    """One line for a run that stopped early: where it got to and how to continue."""
    from ray_ppo.train.checkpoint import linked_step

    saved = linked_step(run_dir)
    at = f" after step {steps_done}" if steps_done else " before its first step"
    if saved is None:
        return f"ray-ppo {command}: {why}{at}; no checkpoint was written (trainer.checkpoint_every=0?), nothing to resume"
    return (f"ray-ppo {command}: {why}{at}; {Path(run_dir) / LINK} holds step {saved}: "
            f"resume with: ray-ppo train --resume {run_dir}")


class CheckpointPublisher:
    """Driver side: each checkpoint that Ray Train stored (rank 0 announces it to the coordinator)
    is published into the run directory as soon as ``poll`` sees it. A failed write (a full disk)
    leaves ``RUN_DIR/checkpoint`` on the previous one and is reported in one line."""

    def __init__(self, coordinator: CoordinatorClient | None, run_dir: str | Path, keep: int):
        self.coordinator, self.run_dir, self.keep = coordinator, Path(run_dir), keep
        self.seen = 0
        self.published_step: int | None = None
        self._lock = threading.Lock()  # the metrics thread and fit()'s clean-up both poll

    def poll(self) -> None:
        with self._lock:
            try:
                new = self.coordinator.call("checkpoints_since", self.seen, timeout=10)
            except Exception:  # the coordinator is gone: nothing more to publish
                return
            for step, checkpoint in new:
                self.seen += 1
                self.publish(step, checkpoint)

    def publish(self, step: int, checkpoint: Any) -> None:
        """Publish the checkpoint of ``step`` (a ``ray.train.Checkpoint``) unless it already is; the
        first one published says its size (``size_line``)."""
        if step == self.published_step:
            return
        try:
            with checkpoint.as_directory() as directory:
                published = publish_checkpoint(directory, self.run_dir, step, keep=self.keep)
            if self.published_step is None:
                print(size_line(published, self.run_dir, step, self.keep), flush=True)
            self.published_step = step
        except (OSError, CheckpointError) as e:
            print(f"ray-ppo: the checkpoint of step {step} was not published to {self.run_dir / LINK} ({e}); "
                  f"it still holds step {self.published_step}", file=sys.stderr, flush=True)

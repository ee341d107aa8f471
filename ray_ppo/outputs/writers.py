"""A run's output files, the same for ``ray-ppo train``/``local``, ``PPOTrainer(output_dir=...)`` and
each Tune trial: ``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``, TensorBoard events and,
when the run closes, ``curves.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ray_ppo.config import Config


def run_outputs(cfg: Config, out_dir: str | Path, resume_after_step: int | None = None,
                progress: bool = True) -> tuple[list[Callable[[dict], None]], Callable[[list[dict]], None]]:
    """Per-step callbacks (run files and, with ``progress``, the progress bar or live line) and a
    closer that also draws ``curves.png``."""
    from ray_ppo.outputs.evals import read_evals
    from ray_ppo.outputs.plots import plot_run
    from ray_ppo.outputs.tracking import LiveLine, Progress, RunDirectory, read_metrics

    out_dir = Path(out_dir)
    run_dir = RunDirectory(out_dir, cfg, tensorboard=cfg.logging.tensorboard, resume_after_step=resume_after_step)
    callbacks: list[Callable[[dict], None]] = [run_dir]
    if progress:
        callbacks.append(Progress(cfg.trainer.total_steps) if cfg.logging.progress else LiveLine(cfg.trainer.total_steps))

    def close(history: list[dict]) -> None:
        for callback in callbacks:
            if isinstance(callback, Progress):
                callback.close()
        run_dir.close()
        if history:
            plot_run(read_metrics(out_dir / "metrics.jsonl"), out_dir / "curves.png", read_evals(out_dir))
    return callbacks, close

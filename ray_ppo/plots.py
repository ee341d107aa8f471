"""Pictures and tables of finished runs: a run's training curves, a sweep's curves, a sweep's trials as CSV.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so no display is needed and the
process-wide matplotlib backend is left alone. Files are written atomically: a temporary file in
the target directory, then ``os.replace``.
"""

from __future__ import annotations

import csv
import math
import numbers
import os
import uuid
from pathlib import Path

RUN_PANELS = (("reward_mean", "reward"), ("kl", "KL(pi || pi_ref), k1"), ("policy_loss", "policy loss"),
              ("value_loss", "value loss"))
"""(metric key, y-axis label) of the four panels of ``plot_run``; the metrics are defined in docs/metrics.md."""


def plot_run(rows: list[dict], path: str | Path, evals: list[dict] | None = None) -> Path:
    """One PNG of a run's rows (``metrics.jsonl``): reward (± reward_std band), kl, policy and value loss by step,
    and with ``evals`` (``eval.jsonl``) a fifth panel, held-out accuracy by the step evaluated.

    A panel whose metric is missing from every row says so instead of drawing a curve.
    """
    done = sorted((e for e in evals or [] if e.get("error") is None), key=lambda e: e["step"])
    fig, axes = _figure(nrows=3 if done else 2, ncols=2, figsize=(11, 10.5 if done else 7), sharex=True)
    if done:
        _eval_panel(axes[2, 0], done)
        axes[2, 1].set_visible(False)
    for ax, (key, label) in zip(axes.flat, RUN_PANELS):
        steps, values = _series(rows, key)
        ax.set_title(key)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if not steps:
            ax.text(0.5, 0.5, f"no '{key}' in the rows", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        if key == "reward_mean":
            _std_band(ax, rows)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"training curves ({len(rows)} steps)")
    return _save(fig, path)


def _eval_panel(ax, evals: list[dict]) -> None:
    steps = [e["step"] for e in evals]
    ax.plot(steps, [e["accuracy"] for e in evals], marker="o")
    ax.set_title("eval/accuracy")
    ax.set_ylabel(f"held-out accuracy ({evals[-1]['num_prompts']} prompts)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def plot_sweep(trials: dict[str, list[dict]], path: str | Path, metric: str = "reward_mean") -> Path:
    """One PNG with one ``metric``-by-step curve per trial; the legend names the trials by their labels."""
    fig, axes = _figure(nrows=1, ncols=1, figsize=(9, 5.5), squeeze=False)
    ax = axes[0, 0]
    for label, rows in trials.items():
        steps, values = _series(rows, metric)
        ax.plot(steps, values, label=label)
    ax.set_title(f"{metric} by trial")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if trials:
        ax.legend(fontsize="small")
    return _save(fig, path)


def write_trials_csv(rows: list[dict], path: str | Path) -> Path:
    """A CSV with one line per trial; the columns are the union of the rows' keys in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return _atomic_write(path, lambda f: _write_csv(f, columns, rows), mode="w", newline="")


def _write_csv(f, columns: list[str], rows: list[dict]) -> None:
    writer = csv.DictWriter(f, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where ``key`` holds a finite number (non-finite values are null in metrics.jsonl)."""
    points = [(row["step"], row[key]) for row in rows if _finite(row.get(key))]
    return [step for step, _ in points], [value for _, value in points]


def _std_band(ax, rows: list[dict]) -> None:
    band = [(r["step"], r["reward_mean"], r["reward_std"]) for r in rows
            if _finite(r.get("reward_mean")) and _finite(r.get("reward_std"))]
    if band:
        steps, means, stds = zip(*band)
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        alpha=0.25, label="± reward_std")
        ax.legend(fontsize="small")


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _figure(nrows: int, ncols: int, figsize: tuple[float, float], **kwargs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _save(fig, path: str | Path) -> Path:
    return _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), mode="wb")


def _atomic_write(path: str | Path, write, mode: str, **open_kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path

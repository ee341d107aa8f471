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
"""(metric key, y-axis label) of ``plot_run``'s panels, each drawn when the rows have its metric
(a GRPO run without a KL term has no ``kl`` and, without a critic, no ``value_loss``); the
metrics are defined in docs/metrics.md."""
ENV_LABELS = {"env/turns": "policy turns per episode", "env/fault": "share of episodes ended by a fault"}
"""y-axis labels of the ``env/...`` panels; any other ``env/<count>`` is a mean per episode."""


def plot_run(rows: list[dict], path: str | Path, evals: list[dict] | None = None) -> Path:
    """One PNG of a run's rows (``metrics.jsonl``): ``run_figure``."""
    return _save(run_figure(rows, evals), path)


def run_figure(rows: list[dict], evals: list[dict] | None = None):
    """A run's curves by step, two panels a row: reward (± reward_std band), kl, policy and value
    loss (``RUN_PANELS``, those the rows have), one panel per ``env/...`` metric of a multi-turn
    run, and with ``evals`` (``eval.jsonl``) held-out accuracy by the step evaluated."""
    panels = run_panels(rows)
    done = sorted((e for e in evals or [] if e.get("error") is None), key=lambda e: e["step"])
    count = len(panels) + bool(done)
    nrows = max(1, math.ceil(count / 2))
    fig, axes = _figure(nrows=nrows, ncols=2, figsize=(11, 3.5 * nrows), squeeze=False)
    cells = list(axes.flat)
    for ax, (key, label) in zip(cells, panels):
        _metric_panel(ax, rows, key, label)
    if done:
        _eval_panel(cells[len(panels)], done)
    for ax in cells[count:]:
        ax.set_visible(False)
    for ax in cells[max(0, count - 2):count]:  # the lowest panel of each column
        ax.set_xlabel("step")
    fig.suptitle(f"training curves ({len(rows)} steps)")
    return fig


def run_panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(metric key, y-axis label) of the metric panels of ``run_figure``: the ``RUN_PANELS`` that
    some row has a number for, then the ``env/...`` metrics, by name."""
    present = {key for row in rows for key, value in row.items() if _finite(value)}
    env = sorted(key for key in present if key.startswith("env/"))
    return ([(key, label) for key, label in RUN_PANELS if key in present]
            + [(key, ENV_LABELS.get(key, "mean per episode")) for key in env])


def _metric_panel(ax, rows: list[dict], key: str, label: str) -> None:
    steps, values = _series(rows, key)
    ax.plot(steps, values, marker="." if len(steps) < 50 else None)
    ax.set_title(key)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if key == "reward_mean":
        _std_band(ax, rows)


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

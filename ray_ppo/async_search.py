"""Tune picks the detached pipeline's knobs: the best reward at a fixed wall-clock budget per trial.

    from ray_ppo.async_search import async_search
    pick = async_search(load_config("configs/tiny.yaml"), budget_s=60)
    print(pick.summary())

``ray-ppo tune --async-search BUDGET_S`` runs it from the command line. Two phases, both through
``ray_ppo.sweep.sweep`` (one ``PPOTrainer`` per trial):

1. **Search**: ``num_samples`` random settings of ``ASYNC_SPACE`` (makers, staleness bound,
   push interval, generation batch), every trial limited to ``budget_s`` seconds of training
   (``trainer.time_budget_s``; start-up is not counted; ``trainer.total_steps`` still caps it, so
   raise it where trials finish their steps inside the budget), with ASHA stopping weak trials early
   on ``elapsed_s`` (rungs at budget/4, budget/2), ranked by ``reward_mean`` at the budget.
2. **Confirm**: the recommended setting and the config's own (the default) run again, side by
   side, ``repeats`` times each, to the full budget: the gain printed is measured there, not
   taken from the search (where the best of many noisy trials is biased upwards).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from ray_ppo.config import Config

ASYNC_SPACE: dict[str, list] = {
    "maker.num_makers": [1, 2, 4],
    "ppo.max_staleness": [1, 2, 4],
    "trainer.update_steps": [1, 2, 4],
    "maker.batch_size": [16, 32, 64],
}
"""What ``--async-search`` searches unless ``--grid`` gives the space."""
METRIC = "reward_mean"


@dataclass
class AsyncPick:
    """The outcome: the recommended setting, the default, and their confirmed rewards."""

    budget_s: float
    total_steps: int  # trainer.total_steps: a trial also ends there, if it comes before the budget
    recommended: dict[str, Any]
    default: dict[str, Any]
    recommended_rewards: list[float]
    default_rewards: list[float]
    search_trials: list[dict] = field(default_factory=list)

    @property
    def gain(self) -> float:
        """Median reward of the recommended setting minus the default's, at the same budget."""
        return _median(self.recommended_rewards) - _median(self.default_rewards)

    def summary(self) -> str:
        rec, dflt = _median(self.recommended_rewards), _median(self.default_rewards)
        same = self.recommended == self.default
        return (f"recommended: {_fmt(self.recommended)}{' (the default)' if same else ''}\n"
                f"  {METRIC} at {self.budget_s:g} s of training or {self.total_steps} steps, whichever came first: "
                f"{rec:.4f} (runs: {_rounded(self.recommended_rewards)}) "
                f"vs default {_fmt(self.default)}: {dflt:.4f} (runs: {_rounded(self.default_rewards)})\n"
                f"  measured gain over the default: {self.gain:+.4f}")


def budgeted(base: Config, budget_s: float) -> Config:
    """``base`` with a training budget of ``budget_s`` seconds and a report every step (ASHA's rungs)."""
    if budget_s <= 0:
        raise ValueError(f"the async search needs a budget > 0 seconds per trial, got {budget_s:g}")
    return base.with_overrides({"trainer.time_budget_s": budget_s, "logging.report_every": 1})


def async_search(base: Config, budget_s: float, space: Mapping[str, Sequence] | None = None, *, num_samples: int = 8,
                 repeats: int = 1, max_concurrent_trials: int | None = None, output_dir: str | None = None,
                 progress: TextIO | None = None) -> AsyncPick:
    """Search ``space`` (default ``ASYNC_SPACE``) at ``budget_s`` seconds per trial, then confirm.
    ``progress``: where to print a line per phase and per ended trial, in place of Tune's status
    tables (the CLI passes stdout); None leaves Tune's own output."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from ray_ppo.sweep import PRESET_KEY, sweep, trial_lines

    def phase(title: str, keys: list[str], trials: int) -> dict:
        if progress is None:
            return {}
        print(title, file=progress, flush=True)
        return {"verbose": 0, "callbacks": [trial_lines(keys, METRIC, stream=progress, total=trials)]}

    space = dict(space or ASYNC_SPACE)
    cfg = budgeted(base, budget_s)
    root = Path(output_dir or f"runs/{base.name}-async-search").resolve()
    asha = ASHAScheduler(time_attr="elapsed_s", max_t=budget_s, grace_period=budget_s / 4, reduction_factor=2)
    search = sweep(cfg, {k: tune.choice(list(v)) for k, v in space.items()}, metric=METRIC, mode="max",
                   num_samples=num_samples, scheduler=asha, max_concurrent_trials=max_concurrent_trials,
                   output_dir=str(root / "search"),
                   **phase(f"search: {num_samples} setting{'s' * (num_samples != 1)}, {budget_s:g} s of training each "
                           f"(at most trainer.total_steps={base.trainer.total_steps} steps)",
                           list(space), num_samples))
    default = {k: base.get(k) for k in space}
    recommended = {k: search.best_config[k] for k in space}
    presets = [default] if recommended == default else [default, recommended]
    confirm = sweep(cfg, {PRESET_KEY: tune.grid_search(presets)}, metric=METRIC, mode="max", num_samples=repeats,
                    max_concurrent_trials=max_concurrent_trials, output_dir=str(root / "confirm"),
                    **phase(f"confirm: {' and '.join(_fmt(p) for p in presets)}, {repeats} run(s) each "
                            f"(first: the default)", [PRESET_KEY], len(presets) * repeats))
    rewards = {i: [t[METRIC] for t in confirm.trials if t[PRESET_KEY] == p and t[METRIC] is not None]
               for i, p in enumerate(presets)}
    return AsyncPick(budget_s, base.trainer.total_steps, recommended, default, rewards[len(presets) - 1], rewards[0],
                     search.trials)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _rounded(xs: list[float]) -> list[float]:
    return [round(x, 4) for x in xs]


def _fmt(setting: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items())

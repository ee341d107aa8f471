"""Tune picks the detached pipeline's knobs: the best reward at a fixed wall-clock budget per trial.

    from ray_ppo.cluster.async_search import async_search
    pick = async_search(load_config("configs/tiny.yaml"), budget_s=60)
    print(pick.summary())

``ray-ppo tune --async-search BUDGET_S`` runs it from the command line. Two phases, both through
``ray_ppo.cluster.sweep.sweep`` (one ``PPOTrainer`` per trial):

1. **Search**: ``num_samples`` random settings of ``ASYNC_SPACE`` (makers, staleness bound,
   push interval, generation batch), every trial limited to ``budget_s`` seconds of training
   (``trainer.time_budget_s``; start-up is not counted; ``trainer.total_steps`` still caps it, so
   raise it where trials finish their steps inside the budget), with ASHA stopping the weaker half
   of the trials at ``first_rung`` of the budget (``elapsed_s``; default half of it, then at each
   doubling below the budget), ranked by ``reward_mean`` at the budget.
2. **Confirm**: the recommended setting and the config's own (the default) run again, side by
   side, to the full budget, once at each of ``repeats`` seeds (the config's ``seed`` and the
   ones after it): the gain printed is measured there, not taken from the search (where the best
   of many noisy trials is biased upwards), and over seeds, not at the search's one (a run with
   one maker repeats itself at a seed, so repeats at one seed measure only timing noise). The two
   settings are compared seed by seed: at how many seeds the pick is higher, and the exact
   two-sided p-value of a sign-flip test of the mean difference.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from ray_ppo.config import Config, ConfigError

ASYNC_SPACE: dict[str, list] = {
    "maker.num_makers": [1, 2, 4],
    "ppo.max_staleness": [1, 2, 4],
    "trainer.update_steps": [1, 2, 4],
    "maker.batch_size": [16, 32, 64],
}
"""What ``--async-search`` searches unless ``--grid`` gives the space."""
METRIC = "reward_mean"
FIRST_RUNG = 0.5
"""ASHA's first stop, as a share of the budget: earlier, before any setting has learned, trials
are stopped on noise (benchmarks/README.md, "Tune picks the async knobs")."""
EXACT_TEST_MAX_SEEDS = 16
"""The sign-flip test enumerates 2^n sign patterns; above this many seeds the summary gives no p."""


@dataclass
class AsyncPick:
    """The outcome: the recommended setting, the default, and their confirmed rewards by seed."""

    budget_s: float
    total_steps: int  # trainer.total_steps: a trial also ends there, if it comes before the budget
    recommended: dict[str, Any]
    default: dict[str, Any]
    recommended_rewards: dict[int, float]  # seed -> reward_mean at the budget (seeds whose run gave one)
    default_rewards: dict[int, float]
    search_trials: list[dict] = field(default_factory=list)

    @property
    def gain(self) -> float:
        """Median reward of the recommended setting minus the default's, at the same budget."""
        return _median(self.recommended_rewards) - _median(self.default_rewards)

    @property
    def paired(self) -> tuple[int, int, float | None]:
        """Over the seeds where both settings gave a reward: (seeds where the pick is higher,
        seeds, exact two-sided sign-flip p-value of the mean difference; None above
        ``EXACT_TEST_MAX_SEEDS`` seeds or without any)."""
        seeds = sorted(set(self.recommended_rewards) & set(self.default_rewards))
        diffs = [self.recommended_rewards[s] - self.default_rewards[s] for s in seeds]
        p = sign_flip_p(diffs) if 0 < len(diffs) <= EXACT_TEST_MAX_SEEDS else None
        return sum(d > 0 for d in diffs), len(diffs), p

    def summary(self) -> str:
        rec, dflt = _median(self.recommended_rewards), _median(self.default_rewards)
        same = self.recommended == self.default
        lines = [f"recommended: {_fmt(self.recommended)}{' (the default)' if same else ''}",
                 f"  {METRIC} at {self.budget_s:g} s of training or {self.total_steps} steps, whichever came first, "
                 f"median over seeds: {rec:.4f} ({_runs(self.recommended_rewards)}) "
                 f"vs default {_fmt(self.default)}: {dflt:.4f} ({_runs(self.default_rewards)})"]
        gain = f"  measured gain over the default: {self.gain:+.4f}"
        if not same:
            higher, seeds, p = self.paired
            gain += f" (higher at {higher} of {seeds} seeds" + ("" if p is None else f", sign-flip p = {p:.3g}") + ")"
        return "\n".join([*lines, gain])


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p-value of a sign-flip permutation test of the mean of paired differences:
    under "no difference" each pair's sign is a coin flip; the share of all 2^n sign patterns
    whose |sum| reaches the observed one."""
    observed = abs(sum(diffs))
    flips = itertools.product((1, -1), repeat=len(diffs))
    extreme = sum(abs(sum(sign * d for sign, d in zip(signs, diffs))) >= observed - 1e-12 for signs in flips)
    return extreme / 2 ** len(diffs)


def budgeted(base: Config, budget_s: float) -> Config:
    """``base`` with a training budget of ``budget_s`` seconds and a report every step (ASHA's rungs)."""
    if budget_s <= 0:
        raise ConfigError(f"the async search needs a budget > 0 seconds per trial, got {budget_s:g} (--async-search)")
    return base.with_overrides({"trainer.time_budget_s": budget_s, "logging.report_every": 1})


def async_search(base: Config, budget_s: float, space: Mapping[str, Sequence] | None = None, *, num_samples: int = 8,
                 repeats: int = 1, first_rung: float = FIRST_RUNG, max_concurrent_trials: int | None = None,
                 output_dir: str | None = None, progress: TextIO | None = None) -> AsyncPick:
    """Search ``space`` (default ``ASYNC_SPACE``) at ``budget_s`` seconds per trial, then confirm.
    ``progress``: where to print a line per phase and per ended trial, in place of Tune's status
    tables (the CLI passes stdout); None leaves Tune's own output."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from ray_ppo.cluster.sweep import PRESET_KEY, sweep, trial_lines

    def phase(title: str, keys: list[str], trials: int) -> dict:
        if progress is None:
            return {}
        print(title, file=progress, flush=True)
        return {"verbose": 0, "callbacks": [trial_lines(keys, METRIC, stream=progress, total=trials)]}

    space = dict(space or ASYNC_SPACE)
    cfg = budgeted(base, budget_s)
    seeds = confirm_seeds(base, repeats)
    root = Path(output_dir or f"runs/{base.name}-async-search").resolve()
    check_first_rung(first_rung)
    asha = ASHAScheduler(time_attr="elapsed_s", max_t=budget_s, grace_period=budget_s * first_rung, reduction_factor=2)
    search = sweep(cfg, {k: tune.choice(list(v)) for k, v in space.items()}, metric=METRIC, mode="max",
                   num_samples=num_samples, scheduler=asha, max_concurrent_trials=max_concurrent_trials,
                   output_dir=str(root / "search"),
                   **phase(f"search: {num_samples} setting{'s' * (num_samples != 1)}, {budget_s:g} s of training each "
                           f"(at most trainer.total_steps={base.trainer.total_steps} steps); ASHA stops the weaker "
                           f"half at {budget_s * first_rung:g} s",
                           list(space), num_samples))
    default = {k: base.get(k) for k in space}
    recommended = {k: search.best_config[k] for k in space}
    presets = [default] if recommended == default else [default, recommended]
    confirm = sweep(cfg, {"seed": tune.grid_search(seeds), PRESET_KEY: tune.grid_search(presets)}, metric=METRIC,
                    mode="max", max_concurrent_trials=max_concurrent_trials, output_dir=str(root / "confirm"),
                    **phase(f"confirm: {' and '.join(_fmt(p) for p in presets)}, one run each at "
                            f"{_seeds(seeds)}", ["seed", PRESET_KEY], len(presets) * len(seeds)))
    rewards = [{t["seed"]: t[METRIC] for t in confirm.trials if t[PRESET_KEY] == p and t[METRIC] is not None}
               for p in presets]
    return AsyncPick(budget_s, base.trainer.total_steps, recommended, default, rewards[-1], rewards[0], search.trials)


def check_first_rung(first_rung: float) -> float:
    """``first_rung``, if it is a share of the budget in (0, 1): ASHA's first stop inside the budget."""
    if not 0 < first_rung < 1:
        raise ConfigError(f"ASHA's first stop must come inside the budget: a share in (0, 1), got {first_rung:g} "
                          f"(--first-rung; default {FIRST_RUNG:g})")
    return first_rung


def confirm_seeds(base: Config, repeats: int) -> list[int]:
    """The confirmation's seeds: the config's ``seed`` and the ``repeats - 1`` after it."""
    if repeats < 1:
        raise ConfigError(f"the confirmation needs at least 1 run per setting, got repeats={repeats} "
                          f"(--confirm-repeats)")
    seeds = [base.seed + i for i in range(repeats)]
    try:  # before any trial: the last seed must be a valid one too
        base.with_overrides({"seed": seeds[-1]})
    except ConfigError as e:
        raise ConfigError(f"the confirmation runs at seeds {seeds[0]}-{seeds[-1]} (seed={base.seed} and the "
                          f"--confirm-repeats {repeats} - 1 after it): {e}") from None
    return seeds


def _median(rewards: Mapping[int, float]) -> float:
    return statistics.median(rewards.values()) if rewards else float("nan")


def _runs(rewards: Mapping[int, float]) -> str:
    return "runs by seed: " + ", ".join(f"{seed}: {r:.4f}" for seed, r in sorted(rewards.items())) if rewards \
        else "no run gave a result"


def _seeds(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}"


def _fmt(setting: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items())

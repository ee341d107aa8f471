"""The async search's confirmation, without Ray: its seeds, the seed-by-seed comparison of the
pick with the default, and the summary printed from it."""

import math

import pytest

from ray_ppo.cluster.async_search import AsyncPick, confirm_seeds, sign_flip_p
from ray_ppo.config import Config, ConfigError


def pick(recommended_rewards: dict, default_rewards: dict, recommended=None) -> AsyncPick:
    return AsyncPick(budget_s=30, total_steps=1000, recommended=recommended or {"maker.num_makers": 1},
                     default={"maker.num_makers": 2}, recommended_rewards=recommended_rewards,
                     default_rewards=default_rewards)


def test_the_confirmation_runs_at_the_configs_seed_and_the_ones_after_it():
    assert confirm_seeds(Config(seed=7), 3) == [7, 8, 9]
    assert confirm_seeds(Config(), 1) == [0]


@pytest.mark.parametrize("repeats", [0, -2])
def test_no_confirmation_run_is_refused_with_the_option_named(repeats):
    with pytest.raises(ConfigError, match=rf"repeats={repeats} \(--confirm-repeats\)"):
        confirm_seeds(Config(), repeats)


def test_a_seed_past_the_last_valid_one_fails_before_any_trial():
    with pytest.raises(ConfigError, match=r"seeds 4294967294-4294967296 .*seed=4294967296 is invalid"):
        confirm_seeds(Config(seed=2**32 - 2), 3)


def test_sign_flip_p_counts_the_sign_patterns_as_extreme_as_the_observed_mean():
    assert sign_flip_p([0.1, 0.2, 0.3]) == 2 / 8  # only all-plus and all-minus reach |0.6|
    assert sign_flip_p([0.3, -0.1]) == 1.0  # every pattern's |sum| (0.2 or 0.4) reaches the observed 0.2
    assert sign_flip_p([0.3, 0.2, -0.1]) == 4 / 8  # |0.4|: as observed, 0.3+0.2+0.1 and their negations
    assert sign_flip_p([0.1] * 6) == 2 / 64


def test_the_pick_is_compared_with_the_default_at_the_seeds_both_ran():
    """A seed whose run gave no result (a failed trial) is left out of the pairing, not of the medians."""
    p = pick({0: 0.70, 1: 0.60, 2: 0.65, 3: 0.9}, {0: 0.50, 1: 0.62, 2: 0.40})
    assert p.paired == (2, 3, sign_flip_p([0.20, -0.02, 0.25]))
    assert math.isclose(p.gain, 0.675 - 0.50)
    text = p.summary()
    assert "median over seeds: 0.6750 (runs by seed: 0: 0.7000, 1: 0.6000, 2: 0.6500, 3: 0.9000)" in text
    assert "vs default maker.num_makers=2: 0.5000 (runs by seed: 0: 0.5000, 1: 0.6200, 2: 0.4000)" in text
    assert text.endswith(f"measured gain over the default: +0.1750 (higher at 2 of 3 seeds, "
                         f"sign-flip p = {sign_flip_p([0.20, -0.02, 0.25]):.3g})")


def test_no_p_value_past_the_exact_tests_reach_and_no_pairing_when_the_pick_is_the_default():
    many = {seed: 0.5 for seed in range(17)}
    assert pick(many, dict(many)).paired == (0, 17, None)
    assert pick(many, dict(many)).summary().endswith("(higher at 0 of 17 seeds)")
    same = pick({0: 0.5}, {0: 0.5}, recommended={"maker.num_makers": 2})
    assert same.summary().startswith("recommended: maker.num_makers=2 (the default)")
    assert same.summary().endswith("measured gain over the default: +0.0000")


def test_a_confirmation_without_results_says_so():
    assert "(no run gave a result)" in pick({}, {0: 0.5}).summary()
    assert math.isnan(pick({}, {0: 0.5}).gain)


def test_the_search_stops_first_at_half_the_budget_and_the_confirmation_pairs_runs_by_seed(monkeypatch):
    """``async_search`` with Tune's part stood in for (the real sweeps run in tests/ray): ASHA's
    first stop comes at half the budget, and the confirmation runs each setting once per seed."""
    import io

    import ray_ppo.cluster.sweep as sweep_module
    from ray_ppo.cluster.async_search import async_search
    from ray_ppo.cluster.sweep import PRESET_KEY, SweepOutcome

    calls = []
    confirm_rewards = {(0, 8): 0.5, (0, 16): 0.7, (1, 8): 0.6, (1, 16): 0.5, (2, 8): 0.2, (2, 16): 0.6}

    def fake_sweep(cfg, space, **kwargs):
        calls.append((space, kwargs))
        if len(calls) == 1:
            return SweepOutcome({"maker.batch_size": 16}, 0.7, None, "", [{"maker.batch_size": 16}], None)
        trials = [{"seed": seed, PRESET_KEY: {"maker.batch_size": size}, "reward_mean": r}
                  for (seed, size), r in confirm_rewards.items()]
        return SweepOutcome({}, 0.7, None, "", trials, None)

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    progress = io.StringIO()
    result = async_search(Config().with_overrides({"maker.batch_size": 8}), 30, {"maker.batch_size": [8, 16]},
                          num_samples=4, repeats=3, progress=progress)
    (_, search), (confirm_space, confirm) = calls
    # Ray's ASHA keeps its stops as (time, results) rungs, the budget first: one stop, at 15 of 30 s.
    assert [rung for rung, _ in search["scheduler"]._brackets[0]._rungs] == [30, 15]
    assert "scheduler" not in confirm  # the confirmation runs every trial to the budget
    assert confirm_space["seed"] == {"grid_search": [0, 1, 2]}
    assert confirm_space[PRESET_KEY] == {"grid_search": [{"maker.batch_size": 8}, {"maker.batch_size": 16}]}
    assert result.recommended_rewards == {0: 0.7, 1: 0.5, 2: 0.6} and result.default_rewards == {0: 0.5, 1: 0.6, 2: 0.2}
    assert result.paired[:2] == (2, 3)
    assert progress.getvalue().splitlines()[0].endswith("; ASHA stops the weaker half at 15 s")

"""Unit tests for ray_ppo.algo.kl_controller."""

import pytest

from ray_ppo.algo import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_controller_never_changes():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=10_000)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_hand_worked_update():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    # error = 6.6 / 6 - 1 = 0.1 (inside the clip); mult = 1 + 0.1 * 1000 / 10000 = 1.01 -> 0.101
    ctl.update(current_kl=6.6, n_steps=1000)
    assert ctl.value == pytest.approx(0.101)
    # KL on target: error 0, value unchanged
    ctl.update(current_kl=6.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.101)


@pytest.mark.parametrize(
    "current_kl, expected",
    [
        (60.0, 0.102),  # error 60/6 - 1 = 9 -> clipped to 0.2: mult = 1 + 0.2 * 0.1 = 1.02
        (0.0, 0.098),  # error 0/6 - 1 = -1 -> clipped to -0.2: mult = 1 - 0.02 = 0.98
    ],
)
def test_adaptive_error_is_clipped(current_kl, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=current_kl, n_steps=1000)
    assert ctl.value == pytest.approx(expected)


def test_adaptive_state_dict_round_trip():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=7.0, n_steps=500)
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    ctl.update(current_kl=5.0, n_steps=500)
    restored.update(current_kl=5.0, n_steps=500)
    assert restored.value == ctl.value


def test_make_kl_controller_picks_by_target():
    assert isinstance(make_kl_controller(0.1), FixedKLController)
    ctl = make_kl_controller(0.1, kl_target=6.0, kl_horizon=500)
    assert isinstance(ctl, AdaptiveKLController)
    assert (ctl.value, ctl.target, ctl.horizon) == (0.1, 6.0, 500)


def test_adaptive_rejects_bad_target():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(init_kl_coef=0.1, target=0.0, horizon=10_000)

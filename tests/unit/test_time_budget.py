"""trainer.time_budget_s: the train loop's decision to end at a wall-clock budget (single process)."""

import time

import torch

from ray_ppo.config import Config
from ray_ppo.train.collectives import broadcast_time_up


def test_no_budget_never_ends_the_run():
    assert broadcast_time_up(0.0, time.perf_counter() - 1e6, torch.device("cpu")) is False


def test_the_step_that_ends_past_the_budget_is_the_last():
    now = time.perf_counter()
    assert broadcast_time_up(5.0, now - 6.0, torch.device("cpu")) is True
    assert broadcast_time_up(5.0, now - 1.0, torch.device("cpu")) is False


def test_a_negative_budget_is_refused():
    import pytest

    from ray_ppo.config import ConfigError
    with pytest.raises(ConfigError, match="trainer.time_budget_s"):
        Config().with_overrides({"trainer.time_budget_s": -1})

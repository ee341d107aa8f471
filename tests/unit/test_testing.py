"""``ray_ppo.makers.testing.WaitingExperienceMaker``: the stand-in maker of tests and ``overlap_sim.py``."""

import time
from pathlib import Path

import pytest

from ray_ppo.api import resolve_config
from ray_ppo.config import load_config
from ray_ppo.makers.testing import WaitingExperienceMaker
from ray_ppo.models.sync import fingerprint

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def cfg():
    return resolve_config(load_config(REPO / "configs" / "tiny.yaml"))


def test_each_batch_waits_its_entry_and_the_last_entry_repeats(cfg):
    maker = WaitingExperienceMaker(cfg, "m", "cpu", waits=(0.3, 0.0), response_len=3)
    took = []
    for version in range(3):
        start = time.perf_counter()
        items, stats = maker.make_experience([[1, 2], [3, 4]], policy_version=version)
        took.append(time.perf_counter() - start)
        assert [item.policy_version for item in items] == [version, version]
        assert [len(item.response_ids) for item in items] == [3, 3]
        assert stats.num_samples == 2 and stats.num_tokens == 6
        assert stats.generate_s == pytest.approx(took[-1], abs=0.05)  # the wait is what it reports as generation
    assert took[0] >= 0.3 and max(took[1:]) < 0.15
    assert len({item.uid for item in items}) == 2


def test_its_models_are_the_configs_real_ones(cfg):
    from ray_ppo.models.build import build_actor

    maker = WaitingExperienceMaker(cfg, "m", "cpu")
    assert fingerprint(maker.actor.state_dict()) == fingerprint(build_actor(cfg).state_dict())


@pytest.mark.parametrize("waits", [(), (1.0, -0.5)])
def test_bad_waits_are_refused_by_value(cfg, waits):
    with pytest.raises(ValueError, match="waits="):
        WaitingExperienceMaker(cfg, "m", "cpu", waits=waits)

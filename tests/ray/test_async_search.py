"""`ray-ppo tune --async-search` at a tiny budget: Tune picks a pipeline knob, the pick and the
default are rerun to the budget, and no trial leaves actors behind."""

import math
from pathlib import Path

import pytest
import ray

from ray_ppo.async_search import async_search
from ray_ppo.config import load_config

pytestmark = pytest.mark.ray
REPO = Path(__file__).parents[2]
TOTAL_STEPS = 1000  # never reached: the budget ends every trial


def test_async_search_picks_a_setting_and_measures_it_against_the_default(ray_session, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"trainer.total_steps={TOTAL_STEPS}", "trainer.train_batch_size=16", "trainer.mini_batch_size=8",
        "maker.num_makers=1", "maker.batch_size=8", "trainer.pull_timeout_s=60", f"logging.output_dir={tmp_path}"])
    pick = async_search(cfg, budget_s=3.0, space={"maker.batch_size": [8, 16]}, num_samples=2,
                        max_concurrent_trials=2, output_dir=str(tmp_path / "search"))
    assert len(pick.search_trials) == 2 and all(t["status"] == "TERMINATED" for t in pick.search_trials)
    assert pick.default == {"maker.batch_size": 8} and pick.recommended["maker.batch_size"] in (8, 16)
    assert len(pick.default_rewards) == 1 and (pick.recommended == pick.default or len(pick.recommended_rewards) == 1)
    assert math.isfinite(pick.gain)
    assert "measured gain over the default" in pick.summary()
    confirm = list((tmp_path / "search" / "confirm" / "trials").iterdir())
    assert len(confirm) == (1 if pick.recommended == pick.default else 2)
    for run_dir in confirm:  # the budget, not total_steps, ended each confirmation run
        steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
        assert 1 <= steps < TOTAL_STEPS
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].startswith("ray_ppo.")]

"""`ray-ppo tune --async-search` at a tiny budget: Tune picks a pipeline knob, the pick and the
default are rerun to the budget, and no trial leaves actors behind."""

import io
import math
from pathlib import Path

import pytest
import ray

from ray_ppo.cluster.async_search import async_search
from ray_ppo.config import load_config

pytestmark = pytest.mark.ray
REPO = Path(__file__).parents[2]
TOTAL_STEPS = 1000  # never reached: the budget ends every trial


def small_config(tmp_path, *overrides):
    """``tiny.yaml`` with one maker and small batches, ``TOTAL_STEPS``, run files under ``tmp_path``."""
    return load_config(REPO / "configs" / "tiny.yaml", [
        f"trainer.total_steps={TOTAL_STEPS}", "trainer.train_batch_size=16", "trainer.mini_batch_size=8",
        "maker.num_makers=1", "maker.batch_size=8", f"logging.output_dir={tmp_path}", *overrides])


def run_actors_left() -> list:
    """ray_ppo's named actors still alive on the cluster (every trial's should be gone)."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].startswith("ray_ppo.")]


def test_async_search_picks_a_setting_and_measures_it_against_the_default(ray_session, tmp_path):
    """The search space holds one setting other than the default, so the run is the same every time:
    one search trial, then the default and the pick side by side (3 fits of ~40 s on 2 cores; which
    of several trials is best is Tune's ``best_config``)."""
    cfg = small_config(tmp_path, "trainer.pull_timeout_s=60")
    progress = io.StringIO()
    pick = async_search(cfg, budget_s=3.0, space={"maker.batch_size": [16]}, num_samples=1,
                        max_concurrent_trials=2, output_dir=str(tmp_path / "search"), progress=progress)
    assert len(pick.search_trials) == 1 and pick.search_trials[0]["status"] == "TERMINATED"
    assert pick.default == {"maker.batch_size": 8} and pick.recommended == {"maker.batch_size": 16}
    assert list(pick.default_rewards) == [0] and list(pick.recommended_rewards) == [0]  # at the config's seed
    assert math.isfinite(pick.gain)
    assert "measured gain over the default" in pick.summary()
    assert f"at 3 s of training or {cfg.trainer.total_steps} steps, whichever came first" in pick.summary()
    lines = progress.getvalue().splitlines()  # a line per phase and per ended trial, in place of Tune's tables
    assert lines[0] == ("search: 1 setting, 3 s of training each "
                        f"(at most trainer.total_steps={cfg.trainer.total_steps} steps); "
                        "ASHA stops the weaker half at 1.5 s")
    assert lines[1].split(" done:")[0] == "trial 1/1"
    assert lines[2] == "confirm: maker.batch_size=8 and maker.batch_size=16, one run each at seed 0"
    assert [line.split(" done:")[0] for line in lines[3:]] == ["trial 1/2", "trial 2/2"]
    assert all("reward_mean" in line for line in lines[1:2] + lines[3:])
    confirm = list((tmp_path / "search" / "confirm" / "trials").iterdir())
    assert len(confirm) == 2
    for run_dir in confirm:  # the budget, not total_steps, ended each confirmation run
        steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
        assert 1 <= steps < TOTAL_STEPS
    assert not run_actors_left()


def test_a_trial_that_tune_stops_early_leaves_no_cpus_reserved(ray_session, tmp_path):
    """Tune ends the process of a trial it stops (here: every trial, at its first result), so the
    trial's Ray Train controller dies without removing its worker group's placement group. On a
    cluster that serves the state API (the dashboard, as `ray-ppo tune` starts one), Ray Train's
    cleaner removes it; without, the CPUs stayed reserved and later trials could not start."""
    import time

    from ray.tune.schedulers import FIFOScheduler

    from ray_ppo.cluster.readiness import dashboard_url
    from ray_ppo.cluster.sweep import sweep

    class StopAtFirstResult(FIFOScheduler):
        def on_trial_result(self, tune_controller, trial, result):
            return self.STOP

    def reserved() -> list:
        return [pg["bundles"] for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]

    assert dashboard_url()  # the session's cluster serves the state API (tests/ray/conftest.py waits for it)
    before = reserved()
    cfg = small_config(tmp_path, "logging.report_every=1")
    outcome = sweep(cfg, {"ppo.kl_coef": 0.05}, scheduler=StopAtFirstResult(), output_dir=str(tmp_path / "sweep"))
    assert [t["status"] for t in outcome.trials] == ["TERMINATED"]
    assert 1 <= float(outcome.trials[0]["step"]) < TOTAL_STEPS  # stopped, not finished
    deadline = time.monotonic() + 120  # the cleaner polls; a loaded machine is slow to answer
    while (left := reserved()) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == before, f"placement groups still reserved after the stopped trial: {left}"
    assert not run_actors_left()

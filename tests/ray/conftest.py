"""One local Ray cluster for every test under tests/ray (session scope, CPU only)."""

import os
from pathlib import Path

import pytest

from ray_ppo.readiness import wait_for_state_api

RAY_NUM_CPUS = 8
"""Logical CPUs: more than the 2 cores, so fractional makers, a trainer and read tasks all fit."""


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # as the CLI's local cluster (ray_ppo/cli.py)
    # Actors import test helpers by name (e.g. model.reward_fn=faulty_rewards:...): workers inherit this.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    # The dashboard (on loopback), as `ray-ppo tune` starts it: the sweeps here stop trials early,
    # and Ray Train frees a stopped trial's worker-group CPUs only through the state API it serves.
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=True, dashboard_host="127.0.0.1",
             log_to_driver=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    wait_for_state_api()  # up seconds after ray.init, minutes after on a loaded machine
    yield ray
    ray.shutdown()

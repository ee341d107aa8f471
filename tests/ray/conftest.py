"""One local Ray cluster for every test under tests/ray (session scope, CPU only)."""

import os
from pathlib import Path

import pytest

from ray_ppo.cluster.local_cluster import start_local_cluster

RAY_NUM_CPUS = 8
"""Logical CPUs: more than the 2 cores, so fractional makers, a trainer and read tasks all fit."""


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    # Actors import test helpers by name (e.g. model.reward_fn=faulty_rewards:...): workers inherit this.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    # The cluster `ray-ppo tune` starts (with the dashboard, on loopback, whose state API is up when
    # this returns): the sweeps here stop trials early, and Ray Train frees a stopped trial's
    # worker-group CPUs only through that state API.
    if ray.is_initialized():  # a Ray an earlier module started (a bare ray.put starts one): not this cluster
        ray.shutdown()
    start_local_cluster(RAY_NUM_CPUS, sweep=True, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()

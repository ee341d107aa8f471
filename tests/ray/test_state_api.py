"""Ray's state API found on a machine that runs more than one Ray cluster (``ray_ppo.cluster.readiness``)."""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ray_ppo.cluster.readiness import wait_for_state_api

pytestmark = pytest.mark.ray


def state_api_left_to_find_ray() -> str | None:
    """The error of a state-API call that does not name the cluster (as Ray's own default), or None."""
    from ray._private.services import find_gcs_addresses
    from ray.util.state import list_actors

    find_gcs_addresses.cache_clear()  # Ray keeps the clusters it found first
    try:
        list_actors(limit=1, timeout=10, raise_on_missing_output=False)
    except Exception as e:
        return str(e)
    return None


def test_the_state_api_answers_while_another_ray_cluster_runs_on_the_machine(ray_session):
    """A second cluster on the machine (another user's job, or a test's own ``ray start``): the
    state API left to find Ray refuses to choose ("Found multiple active Ray instances"), and a
    sweep took that for a cluster without the dashboard. Named by the connected cluster's
    dashboard, it answers; and a worker of the cluster, which calls it without an address as Ray
    Train's placement-group cleaner does (it frees the CPUs of a trial Tune stopped), reaches it."""
    temp_dir = tempfile.mkdtemp(prefix="rp_other_", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray_bin = Path(sys.executable).parent / "ray"
    other = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--port=6397", f"--temp-dir={temp_dir}",
                              "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # minutes on a loaded machine
        while "multiple active Ray instances" not in (state_api_left_to_find_ray() or ""):
            assert other.poll() is None and time.monotonic() < deadline, "the second cluster did not come up"
            time.sleep(1)
        wait_for_state_api(timeout_s=120)
        assert ray_session.get(ray_session.remote(num_cpus=0)(state_api_left_to_find_ray).remote()) is None
    finally:
        other.terminate()  # `ray start --block` stops the cluster it started
        other.wait(timeout=120)


def test_the_workers_of_a_cluster_ray_ppo_starts_run_at_nice_0(ray_session):
    """Ray's default is nice 15, under every other program on the machine (ray_ppo.cluster.local_cluster)."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=300) == 0

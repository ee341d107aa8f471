"""The environment ``ray_ppo.cluster.local_cluster.start_local_cluster`` gives the cluster it starts
(no cluster: ``ray.init`` is recorded), and its second try when Ray gives up on its node."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import ray

from ray_ppo.cluster import local_cluster as cluster
from ray_ppo.cluster import startup


def started_with(monkeypatch, **env) -> dict:
    """The environment ``ray.init`` saw when ``start_local_cluster`` called it."""
    seen = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))
    with mock.patch.dict(os.environ):  # what start_local_cluster sets is undone afterwards
        os.environ.pop(cluster.WORKER_NICENESS_ENV, None)
        os.environ.update(env)
        cluster.start_local_cluster(4)
    return seen


def test_workers_of_a_local_cluster_run_at_the_niceness_of_the_users_other_programs(monkeypatch):
    assert started_with(monkeypatch)[cluster.WORKER_NICENESS_ENV] == "0"


def test_a_worker_niceness_the_user_set_is_kept(monkeypatch):
    assert started_with(monkeypatch, RAY_worker_niceness="10")[cluster.WORKER_NICENESS_ENV] == "10"


def timed_out_start(failures: int, spawned: list):
    """A stand-in for ``ray.init`` that starts a process (as Ray starts its GCS and raylet) and, its first
    ``failures`` calls, raises the error Ray raises when its node does not register in time."""
    calls = []

    def start():
        calls.append(1)
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if len(calls) <= failures:
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")
    return start, calls


def test_a_start_that_ray_gave_up_on_is_stopped_and_made_once_more(capsys):
    spawned: list = []
    start, calls = timed_out_start(1, spawned)
    startup.start_once_more_if_node_timed_out(start, "ray-ppo train")
    assert len(calls) == 2
    assert spawned[0].wait(timeout=10) is not None  # the failed attempt's process was stopped
    assert spawned[1].poll() is None  # the started cluster's process is left running
    assert "ray-ppo train: Ray's node did not register within Ray's fixed 30 s" in capsys.readouterr().err
    spawned[1].kill()


def test_a_second_timed_out_start_fails_in_words_that_name_the_fix():
    spawned: list = []
    start, calls = timed_out_start(2, spawned)
    with pytest.raises(RuntimeError, match="did not start, twice.*run the command again"):
        startup.start_once_more_if_node_timed_out(start, "ray-ppo train")
    assert len(calls) == 2
    assert all(process.wait(timeout=10) is not None for process in spawned)


def test_any_other_start_error_is_raised_as_it_was_without_a_second_try():
    calls = []

    def start():
        calls.append(1)
        raise ValueError("num_cpus must be > 0")

    with pytest.raises(ValueError, match="num_cpus"):
        startup.start_once_more_if_node_timed_out(start)
    assert calls == [1]

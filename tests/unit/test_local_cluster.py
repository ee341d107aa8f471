"""The environment ``ray_ppo.cluster.local_cluster.start_local_cluster`` gives the cluster it starts
(no cluster: ``ray.init`` is recorded)."""

from __future__ import annotations

import os
from unittest import mock

import ray

from ray_ppo.cluster import local_cluster as cluster


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

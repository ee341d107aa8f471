"""Shared fixtures: the tiny models are built once per test session, in a temporary cache."""

from __future__ import annotations

import os

import pytest
import torch

from ray_ppo.cluster.local_cluster import WORKER_NICENESS_ENV

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's own bound on the dashboard's start-up (60 s) ran out on a loaded 2-core machine, in every
# process that starts a cluster with a dashboard: ray.init() in a test or a README snippet, ray start.
# ray_ppo raises it for the clusters it starts (ray_ppo.cluster.local_cluster); the others read it from here.
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "600")
# Ray starts worker processes at nice 15 unless told otherwise: beside a busy machine's other work they
# got 2-4 % of a core. ray_ppo's own clusters run them at nice 0 (ray_ppo.cluster.local_cluster); the clusters the
# tests start otherwise (ray start, ray.cluster_utils.Cluster, a README snippet's ray.init()) read it here.
os.environ.setdefault(WORKER_NICENESS_ENV, "0")
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory) -> str:
    """Point ``RAY_PPO_CACHE`` at a session temporary directory, so nothing is written to $HOME."""
    cache = str(tmp_path_factory.mktemp("ray_ppo_cache"))
    previous = os.environ.get("RAY_PPO_CACHE")
    os.environ["RAY_PPO_CACHE"] = cache
    yield cache
    if previous is None:
        os.environ.pop("RAY_PPO_CACHE", None)
    else:
        os.environ["RAY_PPO_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_path(tiny_model_cache) -> str:
    """Directory of the built-in tiny causal LM (built on first use)."""
    from ray_ppo.models import ensure_tiny_model

    return str(ensure_tiny_model("lm"))


@pytest.fixture(scope="session")
def tiny_reward_path(tiny_model_cache) -> str:
    """Directory of the built-in tiny one-label reward model (built on first use)."""
    from ray_ppo.models import ensure_tiny_model

    return str(ensure_tiny_model("reward"))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    """The tiny model's tokenizer, loaded for generation (left padding)."""
    from ray_ppo.models import load_tokenizer

    return load_tokenizer(tiny_path)

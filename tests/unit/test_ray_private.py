"""Ray's private modules are used in one file, ``ray_ppo/cluster/ray_private.py``, and what it reads there
still exists: this fails loudly on a Ray release that moves it."""

from __future__ import annotations

import re
from pathlib import Path

from ray_ppo.cluster import ray_private

PACKAGE = Path(ray_private.__file__).parent


def test_only_ray_private_imports_rays_private_modules():
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if re.search(r"\bray\._private\b", p.read_text()))
    assert users == ["ray_private.py"]


def test_what_it_reads_is_where_it_reads_it():
    import ray._private.worker as worker
    from ray._private import ray_constants

    assert hasattr(worker, "_global_node")
    assert isinstance(ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S, int)
    assert ray_private.driver_node() is None  # no cluster in this process


def test_a_constant_is_raised_never_lowered(monkeypatch):
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "RAY_DASHBOARD_STARTUP_TIMEOUT_S", 60)
    ray_private.raise_constant("RAY_DASHBOARD_STARTUP_TIMEOUT_S", 600)
    assert ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S == 600
    ray_private.raise_constant("RAY_DASHBOARD_STARTUP_TIMEOUT_S", 100)
    assert ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S == 600


def test_the_node_timeout_that_a_local_start_tries_once_more_is_still_worded_so():
    import importlib.util

    from ray_ppo.cluster.startup import NODE_TIMED_OUT

    source = Path(importlib.util.find_spec("ray._private.node").origin).read_text()
    assert NODE_TIMED_OUT in source

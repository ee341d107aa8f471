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


def test_what_a_node_is_given_its_agents_ports_through_still_exists():
    import inspect

    from ray._private.node import Node
    from ray._private.parameter import RayParams
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port

    assert list(inspect.signature(Node.__init__).parameters)[1:3] == ["ray_params", "head"]
    assert callable(Node.get_session_dir_path) and callable(Node.start_raylet)
    assert "self.head = head" in inspect.getsource(Node.__init__)
    assert "self._node_id = " in inspect.getsource(Node.__init__)
    fields = inspect.signature(RayParams.__init__).parameters
    assert all(name in fields for name in ray_private.AGENT_PORTS)
    assert callable(persist_port) and DASHBOARD_AGENT_LISTEN_PORT_NAME == "dashboard_agent_listen_port"


def test_ports_are_chosen_for_a_head_node_only_and_the_patch_is_undone(monkeypatch):
    from ray._private import node
    from ray._private.parameter import RayParams

    seen = []
    monkeypatch.setattr(node.Node, "__init__", lambda self, ray_params, head=False, *a, **k: seen.append(ray_params))
    original = node.Node.__init__
    ports = iter(range(40000, 40100))
    with ray_private.agent_ports_chosen(lambda: next(ports)):
        node.Node(RayParams(metrics_export_port=9999), head=True)
        node.Node(RayParams(), head=False)
    assert node.Node.__init__ is original
    head, worker = seen
    assert {name: getattr(head, name) for name in ray_private.AGENT_PORTS} == {
        "metrics_agent_port": 40000, "metrics_export_port": 9999, "dashboard_agent_listen_port": 40001,
        "runtime_env_agent_port": 40002}
    assert not worker.metrics_agent_port and not worker.runtime_env_agent_port

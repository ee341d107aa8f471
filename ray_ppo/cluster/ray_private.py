"""Every use of Ray's private modules (``ray._private``), in one place.

    driver_node()                       # the Ray node this driver started or attached to, or None
    raise_constant(name, value)         # a ``ray._private.ray_constants`` bound read at Ray's import
    with agent_ports_chosen(free_port): # a node started inside has its agents' ports chosen beforehand
        ray.init(address="local", ...)

Ray offers no public call for these, so a Ray upgrade may move them:
``tests/unit/test_ray_private.py`` checks that each still exists where it is read, and fails
loudly when one moves. (Ray Train's own private hook that ``PPOTrainer`` overrides,
``_register_sigint_handler``, is checked by ``tests/unit/test_ray_adapter.py``.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


def driver_node() -> Any:
    """The ``ray._private.node.Node`` of this driver (None before ``ray.init``): it knows whether this
    process started the cluster (``head``) and the dashboard's address (``webui_url``)."""
    import ray._private.worker as worker

    return worker._global_node


def raise_constant(name: str, value: int) -> None:
    """Raise Ray's module constant ``name`` to ``value`` unless it is already higher: Ray reads such
    bounds from the environment once, when it is imported, so setting the variable afterwards is
    not enough for this process."""
    from ray._private import ray_constants

    if getattr(ray_constants, name, value) < value:
        setattr(ray_constants, name, value)


AGENT_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")
"""The ports of a node's agents (fields of Ray's ``RayParams``), which two Python processes the raylet
starts (the dashboard agent and the runtime-env agent) bind. Left unset, the raylet waits as it
starts for each agent to write the port it bound into the session directory, a fixed 15 s per
port, and exits when one is late: the node never registers and ``ray.init`` fails after Ray's
fixed 30 s ("The current node timed out during startup"). An agent is a Python process that
imports much of Ray; on 2 cores beside other busy runs it took longer than 15 s."""


@contextlib.contextmanager
def agent_ports_chosen(choose_port: Callable[[], int]) -> Iterator[None]:
    """Inside: a head node this process starts gets each agent's port from ``choose_port`` before
    its processes start (a port a caller set is kept), so its raylet does not wait for the agents.
    ``ray.init`` passes three of them to the raylet; the dashboard agent's HTTP port it does not
    pass, and keeps at one fixed default that two clusters on one machine would both claim: it
    is chosen too, and written where the raylet reads it, in the file the agent itself writes
    (with the same port) once it has bound it."""
    from ray._private import node
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port

    init, start_raylet = node.Node.__init__, node.Node.start_raylet

    def init_with_ports(self, ray_params, head=False, *args, **kwargs):
        if head:
            for name in AGENT_PORTS:
                if not getattr(ray_params, name) or name == "dashboard_agent_listen_port":
                    setattr(ray_params, name, choose_port())
        init(self, ray_params, head, *args, **kwargs)

    def start_raylet_with_listen_port(self, *args, **kwargs):
        if self.head:
            persist_port(self.get_session_dir_path(), self._node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME,
                         self._ray_params.dashboard_agent_listen_port)
        return start_raylet(self, *args, **kwargs)

    node.Node.__init__, node.Node.start_raylet = init_with_ports, start_raylet_with_listen_port
    try:
        yield
    finally:
        node.Node.__init__, node.Node.start_raylet = init, start_raylet

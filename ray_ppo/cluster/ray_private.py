"""Every use of Ray's private modules (``ray._private``), in one place.

    driver_node()                       # the Ray node this driver started or attached to, or None
    raise_constant(name, value)         # a ``ray._private.ray_constants`` bound read at Ray's import

Ray offers no public call for these, so a Ray upgrade may move them:
``tests/unit/test_ray_private.py`` checks that each still exists where it is read, and fails
loudly when one moves. (Ray Train's own private hook that ``PPOTrainer`` overrides,
``_register_sigint_handler``, is checked by ``tests/unit/test_ray_adapter.py``.)
"""

from __future__ import annotations

from typing import Any


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

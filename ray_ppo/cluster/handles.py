"""How the roles reach each other through Ray, for the modules of a role that hold no Ray code
themselves: the coordinator found by name and called through ``CoordinatorClient``, and object
refs fetched with a lost owner read as ``None``.

    client = CoordinatorClient.find(handles)        # handles: a RunHandles
    status = client.call("status", step)             # blocks for the reply
    sent = client.send("publish_chunk", v, i, client.put(bucket))  # returns at once
    client.wait(sent)                                # raises what a sent call raised
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from ray_ppo.wire.messages import RunHandles


def find_coordinator(handles: RunHandles) -> Any:
    """The run's coordinator actor, looked up by name (``RunHandles`` says why not by handle)."""
    return ray.get_actor(handles.coordinator_name, namespace=handles.namespace)


class CoordinatorClient:
    """Calls to the coordinator actor (``ray_ppo.coordinator.actor.Coordinator``) by method name."""

    def __init__(self, handle: Any):
        self.handle = handle

    @classmethod
    def find(cls, handles: RunHandles) -> CoordinatorClient:
        return cls(find_coordinator(handles))

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """The reply of ``method(*args)``, waited for (at most ``timeout`` seconds)."""
        return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout)

    def send(self, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` and return at once; ``wait`` checks its outcome."""
        return getattr(self.handle, method).remote(*args)

    def wait(self, sent: Sequence[Any]) -> None:
        """Block until every call ``send`` started has finished; re-raise the first that failed."""
        ray.get(list(sent))

    @staticmethod
    def put(value: Any) -> list:
        """``value`` in the object store, its ref nested in a list so that a call passes the ref on
        (fetched where it is used) instead of the value."""
        return [ray.put(value)]


def put_object(value: Any) -> Any:
    """``value`` in the object store, owned by the calling process; returns its ref."""
    return ray.put(value)


def fetch_objects(refs: Sequence[Any]) -> dict:
    """ref -> its value, or ``None`` where the object was lost with the process that owned it."""
    try:
        return dict(zip(refs, ray.get(list(refs))))
    except ray.exceptions.ObjectLostError:  # OwnerDiedError is one; find which, one by one
        out = {}
        for ref in refs:
            try:
                out[ref] = ray.get(ref)
            except ray.exceptions.ObjectLostError:
                out[ref] = None
        return out

"""What the multi-node failure scenarios share (each runs as a script in a subprocess of its
test, with this folder on ``sys.path``): fit in a thread with the error kept, waits with a
deadline, and the coordinator's status as a json-able dict."""

from __future__ import annotations

import dataclasses
import time

POLL_S = 0.1


def fit_recording_error(trainer, seen: dict) -> None:
    """``trainer.fit()``; an exception goes into ``seen["error"]`` (the test fails with it)."""
    try:
        trainer.fit()
    except Exception as e:  # reported in the JSON; the test fails with it
        seen["error"] = f"{type(e).__name__}: {e}"


def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the scenario did not reach its next stage")
        time.sleep(POLL_S)


def coordinator_status(trainer) -> dict:
    """The coordinator's status as a dict; {} before it exists and after fit() removed it."""
    import ray

    try:
        return dataclasses.asdict(ray.get(trainer.coordinator.status.remote(), timeout=30))  # json-able
    except (AttributeError, ray.exceptions.RayActorError):
        return {}

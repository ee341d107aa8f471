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
    except BaseException as e:  # reported in the JSON; the test fails with it (a thread has no one else to tell)
        seen["error"] = f"{type(e).__name__}: {e}"


END_MARGIN_S = 30.0
"""What a scenario keeps of its test's timeout to write its JSON and shut its cluster down."""


def record_end_of_fit(trainer, seen: dict, fit, scenario_start: float, scenario_timeout_s: float) -> None:
    """Wait for the fit thread (until ``END_MARGIN_S`` before the test gives up on the scenario),
    then put its history and the coordinator's final status into ``seen``. A fit that failed has
    no final status (None) and its error is already in ``seen``; one still running is recorded as
    an error, so the test fails with a reason, never with a TypeError or a silent timeout."""
    fit.join(timeout=max(1.0, scenario_start + scenario_timeout_s - END_MARGIN_S - time.monotonic()))
    if fit.is_alive():
        seen["error"] = seen["error"] or f"fit() still running {time.monotonic() - scenario_start:.0f} s into the scenario"
    final = trainer.final_status
    if final is None and not seen["error"]:
        seen["error"] = "fit() returned without the coordinator's final status"
    seen.update(history=trainer.history, final_status=final and dataclasses.asdict(final))


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

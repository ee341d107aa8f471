"""What the multi-node failure scenarios share (each runs as a script in a subprocess of its
test, with this folder on ``sys.path``): fit in a thread with the error kept, waits for a named
stage that give up when the fit ends or the scenario's deadline passes, and the coordinator's
status as a json-able dict."""

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


END_MARGIN_S = 60.0
"""What a scenario keeps of its test's timeout to write its JSON and shut its cluster down."""


def record_end_of_fit(trainer, seen: dict, fit, deadline: float) -> None:
    """Wait for the fit thread (until ``deadline``, ``time.monotonic()``), then put its history
    and the coordinator's final status into ``seen``. A fit that failed has no final status (None)
    and its error is already in ``seen``; one still running is recorded as an error, so the test
    fails with a reason, never with a TypeError or a silent timeout."""
    fit.join(timeout=max(1.0, deadline - time.monotonic()))
    if fit.is_alive():
        seen["error"] = seen["error"] or "fit() still running at the scenario's deadline"
    final = trainer.final_status
    if final is None and not seen["error"]:
        seen["error"] = "fit() returned without the coordinator's final status"
    seen.update(history=trainer.history, final_status=final and dataclasses.asdict(final))


class StageNotReached(RuntimeError):
    """The scenario stopped before one of its stages: the fit ended first, or time ran out."""


def wait_for(stage: str, predicate, fit, deadline: float) -> None:
    """Poll ``predicate`` until it holds. Raise :class:`StageNotReached`, naming ``stage``, once
    the fit thread has ended (a failed fit would otherwise be waited on until the test's timeout,
    which kills the scenario before it can say why) or ``deadline`` (``time.monotonic()``) passed."""
    while not predicate():
        if not fit.is_alive():
            raise StageNotReached(f"fit() ended before the scenario reached: {stage}")
        if time.monotonic() > deadline:
            raise StageNotReached(f"not reached in time: {stage}")
        time.sleep(POLL_S)


def coordinator_status(trainer) -> dict:
    """The coordinator's status as a dict; {} before it exists and after fit() removed it."""
    import ray

    try:
        return dataclasses.asdict(ray.get(trainer.coordinator.status.remote(), timeout=30))  # json-able
    except (AttributeError, ray.exceptions.RayActorError):
        return {}

"""The driver's watch over the makers' loops (``ray_ppo.api._MakerLoops``): how a loop's end reaches the coordinator."""

from __future__ import annotations

import ray
import ray.exceptions

from ray_ppo import api


class Coordinator:
    """Records ``maker_failed.remote`` calls as the coordinator actor would receive them."""

    def __init__(self):
        self.failed: list[tuple] = []
        self.maker_failed = self

    def remote(self, *args):
        self.failed.append(args)


def watched(monkeypatch, outcomes: dict[str, object]) -> tuple[api._MakerLoops, Coordinator]:
    """Loops whose calls (named by ``outcomes``' keys) ended with the given value or exception."""
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))

    def get(ref):
        if isinstance(outcomes[ref], BaseException):
            raise outcomes[ref]
        return outcomes[ref]

    monkeypatch.setattr(ray, "get", get)
    coordinator = Coordinator()
    loops = api._MakerLoops(coordinator, makers={}, registered=None, max_restarts=0)
    loops.running = {ref: (i, ref) for i, ref in enumerate(outcomes)}
    return loops, coordinator


def test_a_loop_that_raised_is_reported_to_the_coordinator_with_its_cause_and_traceback(monkeypatch):
    error = ray.exceptions.RayTaskError("MakerWorker.send_loop", "Traceback ...\nKeyError: 'v3'\n", KeyError("v3"))
    # What ray.get raises: the error as an instance of its cause's class as well, whose missing
    # attributes (function_name, traceback_str) are looked up on the cause.
    loops, coordinator = watched(monkeypatch, {"run": {"made": 8}, "send_loop": error.as_instanceof_cause()})
    loops._check()
    [(maker_id, message, traceback)] = coordinator.failed
    assert (maker_id, message) == (1, "maker_1's send_loop raised KeyError: 'v3'")
    assert traceback.endswith("KeyError: 'v3'")
    assert loops.finished == ["run"] and loops.running == {}


def test_a_maker_that_died_is_reported_with_its_restart_budget(monkeypatch):
    loops, coordinator = watched(monkeypatch, {"run": ray.exceptions.RayActorError()})
    loops._check()
    [(maker_id, message)] = coordinator.failed
    assert maker_id == 0 and message.startswith("maker_0 died and was not restarted (maker.max_restarts=0)")

"""Rank 0 hands a weight push to a background thread: the step goes on while the buckets are put,
the next push waits for the previous one, a failed push fails the run at the next push, and the
run's last push is out before the step returns."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ray_ppo.runtime.loop import _Background, _publish, _StepPlan


class SlowPublisher:
    """Records each push; ``publish`` blocks until ``release`` is set, or raises ``error``."""

    def __init__(self, error: Exception | None = None):
        self.release, self.error, self.done = threading.Event(), error, []

    def gather(self):
        return {"actor.w": torch.ones(4)}

    def to_push(self, state, lora_only):
        return state

    def size(self, state):
        return sum(t.numel() * t.element_size() for t in state.values())

    def publish(self, state, version, kl_coef, partial=False):
        assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        self.done.append(version)
        return 0.0, self.size(state)


def worker(publisher, rank=0):
    cfg = SimpleNamespace(sync=SimpleNamespace(lora_only=False))
    return SimpleNamespace(cfg=cfg, rank=rank, version=0, publisher=publisher, pushing=None,
                           pusher=_Background("push") if rank == 0 else None, kl_ctl=SimpleNamespace(value=0.1))


def plan(step, last=False):
    return _StepPlan(step, last, push=True, checkpoint=False)


def test_the_step_goes_on_while_its_push_is_put():
    pub = SlowPublisher()
    w = worker(pub)
    start = time.perf_counter()
    state, push_s, push_bytes = _publish(w, plan(1))
    assert time.perf_counter() - start < 5 and pub.done == [] and w.version == 1  # handed over, not yet put
    assert push_bytes == 16 and set(state) == {"actor.w"}
    threading.Timer(0.3, pub.release.set).start()
    _publish(w, plan(2))  # waits for push 1 before handing over push 2
    assert pub.done[0] == 1
    w.pushing.result(10)
    assert pub.done == [1, 2]


def test_a_failed_push_fails_the_run_at_the_next_push():
    pub = SlowPublisher(error=RuntimeError("the coordinator refused the push"))
    w = worker(pub)
    _publish(w, plan(1))
    pub.release.set()
    with pytest.raises(RuntimeError, match="refused the push"):
        _publish(w, plan(2))


def test_the_last_push_is_out_before_the_last_step_returns():
    pub = SlowPublisher()
    pub.release.set()
    w = worker(pub)
    _publish(w, plan(1, last=True))
    assert pub.done == [1] and w.pushing is None


def test_only_rank_0_pushes():
    pub = SlowPublisher()
    w = worker(pub, rank=1)
    assert _publish(w, plan(1))[1:] == (0.0, 0) and w.version == 1 and w.pushing is None

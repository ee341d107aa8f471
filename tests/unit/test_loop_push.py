"""Rank 0 hands a weight push to a background thread: the step goes on while the buckets are put,
the next push waits for the previous one, a failed push fails the run at the next push, and the
run's last push is out before the step returns."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ray_ppo.train.loop import _Background, _publish, _StepPlan


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
    threads = SimpleNamespace(pusher=_Background("push") if rank == 0 else None)
    return SimpleNamespace(cfg=cfg, rank=rank, publisher=publisher, threads=threads, kl_ctl=SimpleNamespace(value=0.1))


def plan(step, last=False):
    """Step ``step`` trains at version ``step - 1`` and pushes version ``step``."""
    return _StepPlan(step, step - 1, last, push=True, checkpoint=False)


def test_the_step_goes_on_while_its_push_is_put():
    pub = SlowPublisher()
    w = worker(pub)
    start = time.perf_counter()
    state, push_s, push_bytes = _publish(w, plan(1))
    assert time.perf_counter() - start < 5 and pub.done == []  # handed over, not yet put
    assert push_bytes == 16 and set(state) == {"actor.w"}
    threading.Timer(0.3, pub.release.set).start()
    _publish(w, plan(2))  # waits for push 1 before handing over push 2
    assert pub.done[0] == 1
    w.threads.pusher.last.result(10)
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
    assert pub.done == [1] and w.threads.pusher.last is None  # put, and waited for


def test_only_rank_0_pushes():
    pub = SlowPublisher()
    w = worker(pub, rank=1)
    assert _publish(w, plan(1))[1:] == (0.0, 0) and pub.done == []


def test_the_plan_pushes_every_update_steps_and_at_the_end_and_the_version_follows_the_pushes():
    from ray_ppo.train.loop import _plan

    t = SimpleNamespace(total_steps=5, update_steps=2, checkpoint_every=4)
    plans = [_plan(t, step, version=7) for step in range(1, 6)]
    assert [(p.push, p.checkpoint, p.last) for p in plans] == [
        (False, False, False), (True, False, False), (False, False, False), (True, True, False), (True, True, True)]
    assert [p.next_version for p in plans] == [7, 8, 7, 8, 8]
    ended = plans[0].ending()  # the time budget ran out after step 1 trained
    assert (ended.push, ended.checkpoint, ended.last, ended.next_version) == (True, True, True, 8)

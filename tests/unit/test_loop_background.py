"""The loop's background threads: one per kind of work (pulls ahead, pushes), living as long as
the loop, running what they are handed in order; a pull sent ahead comes back merged."""

import threading
from concurrent.futures import Future

import pytest
import torch

from ray_ppo.core.algo import ExperienceBatch, ExperienceItem
from ray_ppo.runtime.loop import _Background, _pull
from ray_ppo.runtime.transport import Fetched


def test_calls_run_one_after_another_on_one_thread_and_errors_reach_their_future():
    worker, ran, release = _Background("test"), [], threading.Event()

    def call(i):
        if i == 0:
            assert release.wait(10)  # the next call waits for this one
        ran.append((i, threading.current_thread().name))
        if i == 1:
            raise ValueError("call 1 failed")
        return i

    futures = [worker.submit(call, i) for i in range(3)]
    assert not any(f.done() for f in futures)
    release.set()
    assert futures[0].result(10) == 0 and futures[2].result(10) == 2
    with pytest.raises(ValueError, match="call 1 failed"):
        futures[1].result(10)
    assert [i for i, _ in ran] == [0, 1, 2] and {name for _, name in ran} == {"ray_ppo-test"}
    thread = next(t for t in threading.enumerate() if t.name == "ray_ppo-test")
    worker.close()
    thread.join(10)
    assert not thread.is_alive()  # closed: the thread ended


def _items(n):
    return [ExperienceItem.filled(torch.tensor([1, 2]), torch.tensor([3, 4, 5]), reward=float(i), policy_version=0,
                                  uid=str(i)) for i in range(n)]


def test_a_pull_sent_ahead_that_brought_every_item_hands_on_its_thread_s_batch():
    items = _items(4)
    merged = ExperienceBatch.merge(items, 0)
    pending: Future = Future()
    pending.set_result(([], Fetched(items, lost=0), merged))
    got, batch = _pull(None, rank=0, n=4, version=0, timeout_s=1, step=1, pending=pending)  # no coordinator call
    assert got == items and batch is merged

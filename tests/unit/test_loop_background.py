"""The loop's background threads: one per kind of work (pulls ahead, pushes, metrics rows),
living as long as the loop, running what they are handed in order; a pull sent ahead comes back
merged; a step's metrics row is completed and recorded off the step's path."""

import os
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem
from ray_ppo.train import loop
from ray_ppo.train.learner import STALE_KL_PREFIX
from ray_ppo.train.loop import _Background, _pull, _StepPlan
from ray_ppo.wire.transport import Fetched


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


def test_a_pull_sent_ahead_names_every_field_of_its_request(monkeypatch):
    sent = []
    coordinator = SimpleNamespace(pull=SimpleNamespace(remote=lambda request: sent.append(request) or "ref"))
    monkeypatch.setattr(loop, "_fetch", lambda ref: (None, None))  # a pull that brought nothing
    trainer = SimpleNamespace(train_batch_size=4, pull_timeout_s=30.0)
    run = SimpleNamespace(cfg=SimpleNamespace(trainer=trainer), coordinator=coordinator, rank=1, group=2,
                          tokenizer=SimpleNamespace(pad_token_id=0), threads=SimpleNamespace(puller=_Background("test")))
    ahead = loop._pull_ahead(run, step=5, trainer_version=3, version=4)
    assert ahead.fetched.result(timeout=10) == (None, None, None)
    (request,) = sent
    assert (request.rank, request.n, request.trainer_version, request.timeout_s) == (1, 4, 3, 30.0)
    assert (request.pid, request.step, request.for_version, request.group) == (os.getpid(), 5, 4, 2)
    run.threads.puller.close()


class SlowMonitor:
    """The makers' view, read from the coordinator: each read blocks until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.steps: list[int] = []  # the step of each read (its counters are as of that step)

    def metrics(self, step_s, step):
        self.steps.append(step)
        assert self.release.wait(10)
        return {"maker_idle_ratio": 0.5}

    def evals(self, wait=False):
        return []  # no eval section: no evaluations


class Rows:
    """The coordinator's ``record_metrics`` and Ray Train's ``report``, as the loop calls them."""

    def __init__(self):
        self.recorded, self.reported = [], []
        self.record_metrics = SimpleNamespace(remote=self.recorded.append)
        self.get = lambda ref: ref  # ray.get of what record_metrics.remote returned
        self.train = SimpleNamespace(report=lambda metrics, checkpoint=None: self.reported.append(metrics))


def test_rank_0_completes_and_records_each_row_in_the_background_and_reports_when_due(monkeypatch):
    rows, monitor = Rows(), SlowMonitor()
    monkeypatch.setattr(loop, "ray", rows)  # the loop's view of Ray: no cluster in a unit test
    cfg = SimpleNamespace(logging=SimpleNamespace(report_every=2, samples_every=0))
    w = SimpleNamespace(cfg=cfg, rank=0, coordinator=rows, monitor=monitor, rows=loop._Rows(rows), tokenizer=None,
                        threads=SimpleNamespace(reporter=_Background("report")))

    def report(step):
        plan = _StepPlan(step, 0, last=False, push=False, checkpoint=False)
        over_ranks = lambda: {"loss": float(step), f"{STALE_KL_PREFIX}3": float("nan")}  # noqa: E731
        start = time.perf_counter()
        loop._report(w, plan, loop._StepResult(over_ranks, {"step": step, "policy_version": 0}, 1.0, [], {}), None)
        return time.perf_counter() - start

    assert report(1) < 1.0 and rows.recorded == []  # not due: the step went on while its row waits for the makers' view
    threading.Timer(0.3, monitor.release.set).start()
    assert report(2) >= 0.2  # due: Ray Train gets the completed row, so the step waited for it
    assert rows.reported == [{"loss": 2.0, "step": 2, "policy_version": 0, "maker_idle_ratio": 0.5}]
    assert [r["step"] for r in rows.recorded] == [1, 2] == monitor.steps  # every row recorded, in order, nan left out
    assert all(f"{STALE_KL_PREFIX}3" not in r for r in rows.recorded)
    w.threads.reporter.close()

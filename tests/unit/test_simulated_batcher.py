"""``ray_ppo.makers.testing``'s simulated device: ``SimulatedBatcher`` (the streaming maker's batcher
in ``benchmarks/overlap_sim.py``), ``AnswerLengths`` and ``SimulatedDeviceMaker``'s two paths."""

from __future__ import annotations

import functools
import random
import statistics
from types import SimpleNamespace

import pytest

from ray_ppo.makers.testing import AnswerLengths, DeviceLog, SimulatedBatcher, SimulatedDeviceMaker
from ray_ppo.models.continuous import Request

STOP = 2


def batcher(lengths, max_running=2, cap=64, **kwargs) -> SimulatedBatcher:
    """A batcher whose answers take ``lengths`` in submission order; its waits are recorded, not slept."""
    drawn = iter(lengths)
    slept = []
    b = SimulatedBatcher(None, SimpleNamespace(max_new_tokens=cap), 0, [STOP, 7], max_running=max_running,
                         step_s=0.01, draw=lambda: next(drawn), sleep=slept.append, **kwargs)
    b.slept = slept
    return b


def requests(n: int, **kwargs) -> list[Request]:
    return [Request(i, [3, 4], **kwargs) for i in range(n)]


def test_lengths_are_lognormal_seeded_and_capped():
    lengths = AnswerLengths(median=8, sigma=1.0)
    draws = [lengths.draw(random.Random(0), 64) for _ in range(3)]
    assert draws == [lengths.draw(random.Random(0), 64)] * 3  # one seed, one length
    rng = random.Random(1)
    many = [lengths.draw(rng, 64) for _ in range(20000)]
    assert min(many) >= 1 and max(many) == 64  # the cap is reached, never passed
    assert statistics.median(many) == 8
    assert statistics.mean(many) == pytest.approx(lengths.mean(64), rel=0.02)
    assert lengths.mean(64) > 8 * 1.4  # the long tail lifts the mean above the median
    assert AnswerLengths(8).mean(64) == 8 and AnswerLengths(8).draw(rng, 5) == 5
    with pytest.raises(ValueError, match="median"):
        AnswerLengths(0.5, 1.0)


def test_a_sequence_frees_its_slot_at_the_step_it_ends():
    """Two slots; one answer of 5 tokens beside four of 1: the short ones take the other slot one
    after the other while the long one runs; all done in 5 steps, each one wait of step_s."""
    b = batcher([5, 1, 1, 1, 1])
    b.submit(requests(5))
    ends = []
    while b.busy:
        assert len(b.rows) <= 2
        ends.append(sorted(f.key for f in b.step()))
    assert ends == [[1], [2], [3], [4], [0]]
    assert b.steps == 5 and b.slept == [0.01] * 5  # one wait per step, however many rows run
    assert b.slot_steps == 9 and b.utilisation == pytest.approx(0.9)
    assert b.log.totals == {"sequences": 5, "tokens": 9, "steps": 5, "slot_steps": 9, "slept_s": pytest.approx(0.0, abs=0.01)}
    assert b.step() == [] and b.steps == 5 and len(b.slept) == 5  # idle: no step, no wait


def test_each_sequence_finishes_once_with_its_drawn_length():
    rng = random.Random(3)
    drawn = [rng.randint(1, 12) for _ in range(40)]
    b = batcher(drawn, max_running=6, cap=10)
    b.submit(requests(40))
    seen = []
    while b.busy:
        seen += b.step()
        if b.steps % 7 == 0:
            b.swap(lambda: None, b.version + 1)
    assert sorted(f.key for f in seen) == list(range(40))
    for f in seen:
        n = min(drawn[f.key], 10)
        assert len(f.tokens) == len(f.versions) == len(f.log_probs) == n
        assert f.stopped == (n < 10) and (f.tokens[-1] == STOP) == f.stopped
    assert b.slot_steps == sum(len(f.tokens) for f in seen)


def test_swaps_are_recorded_per_token():
    b = batcher([4, 2, 3], max_running=2)
    b.submit(requests(3))
    assert b.step() == [] and b.step()[0].key == 1  # the 2-token answer ends at version 0
    applied = []
    b.swap(lambda: applied.append(True), version=3)
    assert applied and b.kv_kept == 1 and b.kv_recomputed == 0  # the 4-token answer was running
    done = {}
    while b.busy:
        done.update({f.key: f for f in b.step()})
    assert done[0].versions == [0, 0, 3, 3] and done[0].swaps == 1 and done[0].version_runs == [(0, 2), (3, 2)]
    assert done[2].versions == [3, 3, 3] and done[2].swaps == 0  # admitted after the swap
    recompute = batcher([3], kv_at_swap="recompute")
    recompute.submit(requests(1))
    recompute.step()
    recompute.swap(lambda: None, version=1)
    assert recompute.kv_recomputed == 1 and recompute.kv_kept == 0


def test_admission_may_be_held_and_longest_first_orders_the_waiting():
    b = batcher([3, 3, 3], max_running=2)
    b.submit(requests(1))
    b.step()
    b.submit(requests(2))
    b.step(admit=False)  # draining before a between-batches swap: nothing joins
    assert len(b.rows) == 1 and len(b.waiting) == 2
    ordered = batcher([1, 1, 1], max_running=1, schedule="longest_first")
    ordered.submit([Request("short", [3], expected_len=2), Request("unknown", [3]), Request("long", [3], expected_len=9)])
    keys = []
    while ordered.busy:
        keys += [f.key for f in ordered.step()]
    assert keys == ["long", "unknown", "short"]


def test_run_returns_in_request_order_and_refuses_bad_input():
    b = batcher([3, 1, 2], max_running=3)
    assert [len(f.tokens) for f in b.run(requests(3))] == [3, 1, 2]
    with pytest.raises(ValueError, match="empty prompt"):
        b.submit([Request(0, [])])
    with pytest.raises(ValueError, match="max_running"):
        batcher([], max_running=0)


@pytest.fixture(scope="module")
def cfg():
    from ray_ppo.config import Config
    from ray_ppo.models.build import resolve_config

    return resolve_config(Config().with_overrides({"maker.max_new_tokens": 16}))


def test_the_maker_makes_the_same_token_work_batch_by_batch_and_streaming(cfg, tmp_path):
    """One maker, one seed: the same lengths in both paths. Batch by batch, a chunk of ``slots``
    sequences takes its longest answer's steps; streaming, the slots refill, in fewer steps."""
    make = functools.partial(SimulatedDeviceMaker, cfg, "maker_0", "cpu", step_s=0.001,
                             lengths=AnswerLengths(4, 1.0), slots=4, log_dir=tmp_path)
    batch, stream = make(), make()
    items, stats = batch.make_experience([[1, 2]] * 8, policy_version=2, prompts=[f"p{i}" for i in range(8)])
    lengths = [item.response_length for item in items]
    assert stats.num_tokens == sum(lengths) and stats.num_samples == 8 and stats.generate_s > 0
    assert {item.policy_version for item in items} == {2} and items[3].prompt == "p3"
    assert [item.truncated for item in items] == [n == 16 for n in lengths]
    steps = max(lengths[:4]) + max(lengths[4:])
    assert batch.log.totals["steps"] == steps and batch.log.totals["slot_steps"] == sum(lengths)
    batch.log.flush()
    assert DeviceLog.read(tmp_path)["maker_0"]["tokens"] == sum(lengths)

    b = stream.batcher_class(stream.actor, cfg.maker, 0, stream.stop_ids, max_running=4, version=2)
    b.submit(Request(i, [1, 2]) for i in range(8))
    finished = []
    while b.busy:
        finished += b.step()
        if b.steps == 2:
            b.swap(lambda: None, version=3)
    finished.sort(key=lambda f: f.key)
    assert [len(f.tokens) for f in finished] == lengths  # drawn in the same order
    assert b.steps <= steps and stream.log.totals["steps"] == b.steps
    items, stats = stream.experience_of(finished, None, [f"p{i}" for i in range(8)])
    assert [item.response_length for item in items] == lengths and stats.num_tokens == sum(lengths)
    for item, f in zip(items, finished):
        assert item.policy_version == min(f.versions)
        assert item.version_runs == (tuple(f.version_runs) if len(set(f.versions)) > 1 else None)

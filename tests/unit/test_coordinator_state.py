"""Unit tests of the coordinator's state objects (``ray_ppo.coordinator.state``, ``ray_ppo.coordinator.feed.PromptFeed``)
and its messages: plain synchronous calls, no asyncio, no Ray."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from ray_ppo.config import Config
from ray_ppo.coordinator import actor as coordinator_module
from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.coordinator.state import Admission, CoordinatorState, MakerBook, PushRelay, RankBuffers
from ray_ppo.makers.testing import coordinator_config
from ray_ppo.wire.messages import LastPush, MakerStats, MakerStatus, PushHeader
from ray_ppo.wire.transport import ExperienceChunk
from tests.unit.test_coordinator import item, items


def identity_holds(b: RankBuffers) -> bool:
    return b.produced == b.consumed + b.in_flight + b.discarded + b.lost_in_transit


# -- messages -----------------------------------------------------------------------------------


def test_a_misspelt_stat_fails_where_it_is_written():
    with pytest.raises(TypeError, match="num_prompt"):
        MakerStats(num_prompt=3)
    stats = MakerStats(num_prompts=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_prompts = 4


# -- RankBuffers --------------------------------------------------------------------------------


def test_buffers_route_take_and_count():
    b = RankBuffers(num_ranks=2, buffer_size=4)
    chunk = items(6)
    b.accept(chunk.count)
    rest = b.route(chunk, [0, 1])
    assert (rest.count, b.buffered(0), b.buffered(1)) == (0, 3, 3)
    assert b.has_space([0, 1])  # 3 < 4: both still have room
    out: list[ExperienceChunk] = []
    assert b.take(0, 2, out) == 2 and b.buffered(0) == 1
    assert (b.in_flight, b.consumed) == (6, 0)  # taken is not pulled until committed
    b.commit(2)
    assert (b.produced, b.consumed, b.in_flight) == (6, 2, 4) and identity_holds(b)
    b.lost(2)  # their payload died with the maker
    assert (b.consumed, b.lost_in_transit, b.in_flight) == (0, 2, 4) and identity_holds(b)


def test_route_returns_what_does_not_fit_and_put_back_keeps_the_order():
    b = RankBuffers(num_ranks=1, buffer_size=4)
    chunk = items(6)
    b.accept(6)
    rest = b.route(chunk, [0])
    assert (rest.count, b.buffered(0), b.has_space([0])) == (2, 4, False)
    out: list[ExperienceChunk] = []
    b.take(0, 3, out)
    b.put_back(0, out)
    again: list[ExperienceChunk] = []
    b.take(0, 4, again)
    assert [c.start for c in again] == [0, 3] and sum(c.count for c in again) == 4  # same items, same order


def test_drop_stale_counts_and_names_the_dropped_prompts():
    b = RankBuffers(num_ranks=1, buffer_size=16)
    for version in (0, 1, 2):
        chunk = ExperienceChunk.inline([item(version, f"v{version}-{i}") for i in range(2)])
        b.accept(2)
        b.route(chunk, [0])
    assert b.drop_stale(0, oldest_allowed=2) == [-1] * 4  # items made outside a prompt stream: id -1
    assert (b.discarded, b.in_flight, b.buffered(0)) == (4, 2, 2) and identity_holds(b)
    assert b.drop_stale(0, oldest_allowed=2) == []


def test_the_counter_identity_holds_through_any_sequence():
    rng = random.Random(0)
    b = RankBuffers(num_ranks=2, buffer_size=8)
    waiting: list[ExperienceChunk] = []
    for step in range(300):
        action = rng.choice(["send", "route", "pull", "lost", "stale"])
        if action == "send":
            chunk = ExperienceChunk.inline([item(step // 20, f"s{step}-{i}") for i in range(rng.randint(1, 5))])
            b.accept(chunk.count)
            waiting.append(chunk)
        elif action == "route" and waiting:
            rest = b.route(waiting.pop(0), [0, 1])
            if rest.count:
                waiting.insert(0, rest)
        elif action == "pull":
            out: list[ExperienceChunk] = []
            b.commit(b.take(rng.randint(0, 1), rng.randint(1, 6), out))
        elif action == "lost" and b.consumed:
            b.lost(rng.randint(1, b.consumed))
        elif action == "stale":
            b.drop_stale(rng.randint(0, 1), oldest_allowed=step // 20 - 1)
        assert identity_holds(b), (step, action)
        assert b.in_flight == b.buffered(0) + b.buffered(1) + sum(c.count for c in waiting)


# -- Admission ----------------------------------------------------------------------------------


def test_admission_hand_computed():
    # S = 1 version of staleness, 8 items per version, batches of 4 prompts, one item per prompt
    a = Admission(num_makers=2, max_staleness=1, items_per_version=8, prompt_batch_size=4)
    # V = 0, maker v = 0: capacity = (0 + 1 - 0 + 1) * 8 - 0 = 16
    assert a.admits(0, in_flight=0)          # 0 + 0 + 4 <= 16
    a.reserve(0, 4)                          # one batch handed out, not yet sent back
    assert a.admits(0, in_flight=8)          # 8 + 4 + 4 = 16 <= 16
    a.reserve(1, 1)
    assert not a.admits(0, in_flight=8)      # 8 + 5 + 4 = 17 > 16: reservations of every maker count
    a.reserve(0, -4)
    a.reserve(1, -1)

    a.trainer_at(1)
    a.consumed(8, version=1)            # V = 1, consumed_at_version = 8
    assert not a.admits(0, in_flight=0)      # v = 0: (0 + 1 - 1 + 1) * 8 - 8 = 0 < 4
    assert a.admits(1, in_flight=0)          # v = 1: (1 + 1 - 1 + 1) * 8 - 8 = 8 >= 4
    a.reserve(0, 5)
    assert not a.admits(1, in_flight=0)      # 5 + 4 = 9 > 8

    a.trainer_at(3)                          # a new version resets consumed_at_version
    assert a.consumed_at_version == 0 and a.oldest_allowed_at(a.trainer_version) == 2
    a.trainer_at(2)                          # versions never go back
    assert a.trainer_version == 3


def test_admission_counts_groups_and_keeps_the_previous_versions_budget_apart():
    a = Admission(num_makers=1, max_staleness=0, items_per_version=8, prompt_batch_size=2, samples_per_prompt=4)
    assert a.admits(0, in_flight=0)          # (0 + 2) prompts * 4 = 8 <= 8
    a.reserve(0, 1)
    assert not a.admits(0, in_flight=0)      # (1 + 2) * 4 = 12 > 8
    a.trainer_at(1)
    a.consumed(4, version=0)            # a rank finishing version 0's step: not version 1's budget
    assert a.consumed_at_version == 0
    a.consumed(4, version=1)
    a.unconsumed(6)                          # lost in transit: never below zero
    assert a.consumed_at_version == 0


def test_a_restarted_maker_loses_its_reservation():
    a = Admission(num_makers=2, max_staleness=1, items_per_version=8, prompt_batch_size=4)
    a.reserve(0, 4)
    a.reserve(1, 4)
    a.drop(1)
    assert (a.reserved, a.total_reserved) == ({0: 4, 1: 0}, 4)


# -- MakerBook ----------------------------------------------------------------------------------


def test_maker_book_sums_stats_and_reports_the_first_failure():
    book = MakerBook(num_makers=2)
    book.record(0, MakerStats(num_prompts=4, blank=1, truncated=2, num_tokens=10, generate_s=1.5, idle_s=0.5,
                              admission_s=0.25, pause_s=0.1, logprob_gap=(0.3, 0.2, 6)))
    book.record(0, MakerStats(num_tokens=5, generate_s=0.5))
    book.loaded(1, 2)
    book.loaded(1, 1)  # an older push completing late does not move it back
    assert book.snapshot({0: 4}) == {
        0: MakerStatus(version=0, generate_s=2.0, idle_s=0.5, admission_s=0.25, pause_s=0.1, tokens=15, reserved=4),
        1: MakerStatus(version=2)}
    assert book.logprob_gaps == [(0.3, 0.2, 6)]
    assert not book.all_at(2) and book.failure() is None
    book.fail(0, "ValueError: boom")
    assert book.all_at(2)  # a failed maker is not waited for
    failure = book.failure()
    assert isinstance(failure, RuntimeError) and str(failure) == "maker_0 failed (1/2 makers failed): ValueError: boom"
    book.fail(0, "maker_0's loop raised: ValueError: boom")  # the driver's report after the maker's own
    assert str(book.failure()) == "maker_0 failed (1/2 makers failed): ValueError: boom"
    book.restarted(1)
    assert book.versions() == {0: 0, 1: 0} and book.states[1].restarts == 1


def test_maker_book_sums_a_streaming_makers_slots_and_caches_and_keeps_its_latest_running():
    book = MakerBook(num_makers=1)
    book.record(0, MakerStats(running=5, slot_steps=30, slot_capacity=40, kv_kept=3))
    book.record(0, MakerStats(running=2, slot_steps=10, slot_capacity=20, kv_kept=1, kv_recomputed=2))
    s = book.states[0]
    assert (s.running, s.slot_steps, s.slot_capacity, s.kv_kept, s.kv_recomputed) == (2, 40, 60, 4, 2)
    book.restarted(0)  # what ran died with the process
    assert book.states[0].running == 0 and book.states[0].slot_steps == 40


# -- PushRelay ----------------------------------------------------------------------------------


def test_push_relay_keeps_the_latest_push_and_ignores_late_buckets():
    relay = PushRelay()
    assert relay.last is None
    first = relay.start(PushHeader(1, 2, 64, kl_coef=0.1))
    assert relay.add(1, 0, "a") and first.bucket_refs == {0: "a"}
    second = relay.start(PushHeader(2, 1, 32, kl_coef=0.2))
    assert relay.superseded(first) and not relay.superseded(second)
    assert not relay.add(1, 1, "late")  # a bucket of the abandoned push
    assert relay.add(2, 0, "b") and second.bucket_refs == {0: "b"}
    assert (relay.count, relay.last) == (2, LastPush(2, 32))


def test_push_relay_keeps_buckets_that_arrive_before_their_push_starts():
    """The coordinator is an async actor: Ray may run rank 0's publish_chunk before the
    publish_start sent ahead of it."""
    relay = PushRelay()
    assert relay.add(1, 1, "b1")  # push 1's second bucket, before push 1 started
    first = relay.start(PushHeader(1, 2, 64, kl_coef=0.1))
    assert first.bucket_refs == {1: "b1"}
    assert relay.add(1, 0, "a1") and first.bucket_refs == {0: "a1", 1: "b1"}
    assert relay.add(3, 0, "a3") and relay.add(2, 0, "a2")  # two pushes ahead of their starts
    second = relay.start(PushHeader(2, 1, 32, kl_coef=0.2))
    assert second.bucket_refs == {0: "a2"} and relay.early == {3: {0: "a3"}}
    third = relay.start(PushHeader(3, 1, 32, kl_coef=0.2))
    assert third.bucket_refs == {0: "a3"} and relay.early == {}
    assert not relay.add(2, 1, "late")  # superseded: ignored, not kept
    assert relay.early == {} and relay.count == 3


# -- PromptFeed ---------------------------------------------------------------------------------


def test_prompt_feed_serves_by_identity_across_epochs():
    ledger = PromptLedger(shuffle=False)
    feed = PromptFeed(lambda: ["a", "b", "c"], ledger)
    assert not feed.loaded
    feed.load(feed.read())
    first = feed.next(maker_id=0, n=2)
    assert (first.prompts, first.ids, feed.epochs) == (["a", "b"], [0, 1], 1)
    second = feed.next(maker_id=1, n=2)  # wraps into the second epoch: always n prompts
    assert (second.prompts, len(second.ids), feed.served, feed.epochs) == (["c", "a"], 2, 4, 2)
    assert feed.first_prompt == "a"


# -- CoordinatorState: what the actor shell asks of it ------------------------------------------


def test_the_state_of_a_run_takes_its_quantities_from_the_config_sections():
    cfg = Config().with_overrides({"trainer.num_workers": 2, "trainer.train_batch_size": 8, "trainer.mini_batch_size": 8,
                                   "trainer.update_steps": 2, "maker.num_makers": 3, "maker.batch_size": 4,
                                   "maker.samples_per_prompt": 2, "ppo.max_staleness": 3, "topology.routing": "modulo"})
    state = CoordinatorState.of_config(cfg, initial_version=5)
    assert (state.num_ranks, state.num_makers, state.routing, state.buffers.buffer_size) == (2, 3, "modulo", 16)
    a = state.admission
    assert (a.max_staleness, a.items_per_version, a.prompt_batch_size, a.samples_per_prompt) == (3, 32, 4, 2)
    assert a.trainer_version == 5


def test_the_prompts_are_read_once_and_loaded_by_a_transaction():
    ledger = PromptLedger(shuffle=False)
    state = CoordinatorState.of_config(coordinator_config(), ledger=ledger,
                                       feed=PromptFeed(lambda: ["a", "b", "c"], ledger))
    read = state.prompts_to_read()
    state.on_prompts_read(read())
    assert state.prompts_to_read() is None and ledger.num_prompts == 3


def test_metrics_rows_and_stored_checkpoints_are_kept_in_order_for_the_driver():
    state = CoordinatorState.of_config(coordinator_config())
    state.on_metrics({"step": 1})
    state.on_checkpoint_saved(1, "ckpt-1")
    state.on_metrics({"step": 2})
    assert state.metrics_since(0) == [{"step": 1}, {"step": 2}] and state.metrics_since(1) == [{"step": 2}]
    assert state.checkpoints_since(0) == [(1, "ckpt-1")] and state.checkpoints_since(1) == []


def test_a_relay_passes_on_the_buckets_of_its_push_until_a_newer_one_starts():
    state = CoordinatorState.of_config(coordinator_config())
    first = state.on_push_start(PushHeader(1, 2, 64, kl_coef=0.1))
    assert not state.may_relay_bucket(first, 0)  # waits for the bucket
    state.on_push_bucket(1, 0, "a")
    assert state.may_relay_bucket(first, 0) and state.bucket(first, 0) == "a"
    state.on_push_start(PushHeader(2, 1, 32, kl_coef=0.1))
    assert state.superseded(first) and state.may_relay_bucket(first, 1)  # stops waiting
    assert state.bucket(first, 0) is None  # and passes nothing on


def test_the_actor_shell_changes_and_reads_its_state_only_through_the_state_s_methods():
    """The coordinator shell calls ``CoordinatorState``'s transactions and queries; it does not
    reach into the mailbox, the push relay, the feed or a push's buckets."""
    source = Path(coordinator_module.__file__).read_text()
    for reach in ("state.mailbox", "state.pushes", "state.feed", "state.ledger", "push.bucket_refs"):
        assert reach not in source, reach

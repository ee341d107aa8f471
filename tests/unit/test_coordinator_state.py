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
from ray_ppo.wire.transport import ExperienceChunk, resolve
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


@pytest.mark.parametrize("balance", ["count", "tokens"])
def test_the_counter_identity_holds_through_any_sequence(balance):
    rng = random.Random(0)
    b = RankBuffers(num_ranks=2, buffer_size=8, step_items=4, balance=balance)
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


def groups_chunk(tokens: list[int], group_size: int = 2, prefix: str = "g") -> ExperienceChunk:
    """A chunk of ``len(tokens)`` groups of ``group_size`` items; group k's items hold ``tokens[k]``
    tokens between them (a 2-token prompt and the rest as responses)."""
    import torch

    from ray_ppo.algo import ExperienceItem

    out = []
    for k, total in enumerate(tokens):
        each = total // group_size
        for i in range(group_size):
            out.append(ExperienceItem.filled(torch.tensor([3, 4]), torch.ones(each - 2, dtype=torch.long), reward=0.0,
                                             policy_version=0, uid=f"{prefix}{k}-{i}"))
    return ExperienceChunk.of(out, "inline", group_size=group_size)


def step_tokens(b: RankBuffers, rank: int, n: int) -> tuple[int, list[str]]:
    """Pull ``n`` items of ``rank`` (a step): their tokens and uids."""
    out: list[ExperienceChunk] = []
    assert b.take(rank, n, out) == n
    b.commit(n)
    got = resolve(out).items
    return sum(it.prompt_ids.numel() + it.response_ids.numel() for it in got), [it.uid for it in got]


def test_chunks_carry_each_item_s_tokens_and_sum_them_per_group():
    chunk = groups_chunk([10, 40, 6], group_size=2)
    assert chunk.lengths.tolist() == [5, 5, 20, 20, 3, 3] and chunk.group_tokens() == [10, 40, 6]
    head, rest = chunk.split(2)
    assert (head.group_tokens(), rest.group_tokens()) == ([10], [40, 6])
    assert (head.tokens(), rest.tokens(), rest.tokens(rest.stop - 1, rest.stop)) == (10, 46, 3)
    assert ExperienceChunk([object()], 0, 0, 2).group_tokens() is None  # lengths unknown
    assert ExperienceChunk([object()], 0, 0, 2).tokens() == 0


def test_dealing_by_tokens_gives_each_rank_s_step_as_many_items_and_about_as_many_tokens():
    """Two ranks, steps of 8 items (4 groups of 2): the long groups arrive first, one chunk at a
    time as streaming makers send them. Dealt by free space, rank 0's step takes 3 of the 4 long
    groups; dealt by tokens, each step holds 2 long and 2 short, and no item is lost or repeated."""
    arrivals = [[100], [100], [100], [10], [100], [10], [10], [10]]
    spread = {}
    for balance in ("count", "tokens"):
        b = RankBuffers(num_ranks=2, buffer_size=16, step_items=8, balance=balance)
        for k, tokens in enumerate(arrivals):
            chunk = groups_chunk(tokens, prefix=f"c{k}.")
            b.accept(chunk.count)
            assert b.route(chunk, [0, 1]).count == 0
        assert b.buffered(0) == b.buffered(1) == 8
        (t0, u0), (t1, u1) = step_tokens(b, 0, 8), step_tokens(b, 1, 8)
        assert sorted(u0 + u1) == sorted(f"c{k}.0-{i}" for k in range(8) for i in range(2))
        spread[balance] = abs(t0 - t1)
        assert identity_holds(b)
    assert spread == {"count": 180, "tokens": 0}


@pytest.mark.parametrize("pulled_early", [False, True])
def test_a_completed_step_is_dealt_again_longest_first_unless_a_pull_took_part_of_it(pulled_early):
    """Groups of 10, 20, 30 and 100 tokens, one at a time, to two ranks of two groups a step. As
    they come, 10 and 30 go to one rank and 20 and 100 to the other (40 against 120). Dealt again
    longest first: 100 and 10 against 30 and 20 (110 against 50), the best split of two groups
    each. If a rank's pull took its first group before the step was complete, that step stays."""
    b = RankBuffers(num_ranks=2, buffer_size=8, step_items=4, balance="tokens")
    taken: list[ExperienceChunk] = []
    for k, tokens in enumerate([10, 20, 30, 100]):
        chunk = groups_chunk([tokens], prefix=f"c{k}.")
        b.accept(chunk.count)
        assert b.route(chunk, [0, 1]).count == 0
        if pulled_early and k == 0:
            rank = next(r for r in (0, 1) if b.buffered(r))
            b.take(rank, 4, taken)  # a waiting pull takes the group at once
    if pulled_early:
        assert b.take(rank, 2, taken) == 2
        b.commit(4)
        held = sum(it.prompt_ids.numel() + it.response_ids.numel() for it in resolve(taken).items)
        other = step_tokens(b, 1 - rank, 4)[0]
        assert sorted([held, other]) == [40, 120]
    else:
        assert sorted([step_tokens(b, 0, 4)[0], step_tokens(b, 1, 4)[0]]) == [50, 110]
    assert identity_holds(b)


def test_a_group_a_pull_took_still_counts_in_its_rank_s_step():
    """Makers set the pace: a rank's waiting pull takes each group as it comes. The next group
    goes to the other rank, whose step has fewer tokens, though both buffers are empty; a pull
    that gives its group back leaves the counts as they were."""
    b = RankBuffers(num_ranks=2, buffer_size=8, step_items=4, balance="tokens")
    long = groups_chunk([100], prefix="long")
    b.accept(2)
    b.route(long, [0, 1])
    x = next(r for r in (0, 1) if b.buffered(r))
    out: list[ExperienceChunk] = []
    assert b.take(x, 4, out) == 2 and (b.taken[x], b.taken_tokens[x]) == (2, 100)
    for k in range(3):  # whichever way round-robin would break a tie, the short groups go to the other rank
        short = groups_chunk([10], prefix=f"short{k}.")
        b.accept(2)
        b.route(short, [0, 1])
        if k == 0:
            assert (b.buffered(x), b.buffered(1 - x)) == (0, 2)
    b.put_back(x, out)
    assert (b.taken[x], b.taken_tokens[x], b.buffered(x)) == (0, 0, 4) and identity_holds(b)


def test_dealing_by_tokens_fills_the_emptier_rank_s_steps_first_and_respects_free_space():
    b = RankBuffers(num_ranks=2, buffer_size=8, step_items=4, balance="tokens")
    first = groups_chunk([50, 50, 50, 50])
    b.accept(8)
    b.route(first, [0, 1])
    assert (b.buffered(0), b.buffered(1)) == (4, 4)
    step_tokens(b, 0, 4)  # rank 0 trained its step
    more = groups_chunk([10, 10, 10, 10, 10, 10], prefix="m")
    b.accept(12)
    rest = b.route(more, [0, 1])
    assert (b.buffered(0), b.buffered(1), rest.count) == (8, 8, 0)  # rank 0's two steps filled first
    again = groups_chunk([10, 10], prefix="x")
    b.accept(4)
    assert b.route(again, [0, 1]).count == 4 and identity_holds(b)  # no space: nothing placed


@pytest.mark.parametrize("targets, with_lengths", [([0], True), ([0, 1], False)])
def test_dealing_falls_back_to_free_space_where_tokens_cannot_decide(targets, with_lengths):
    """The modulo rule (a maker's ranks, not all) and chunks of unknown lengths: by free space."""
    b = RankBuffers(num_ranks=2, buffer_size=16, step_items=4, balance="tokens")
    chunk = groups_chunk([10, 90, 10, 90])
    if not with_lengths:
        chunk = dataclasses.replace(chunk, lengths=None)
    b.accept(chunk.count)
    b.route(chunk, targets)
    assert [b.buffered(r) for r in (0, 1)] == ([8, 0] if targets == [0] else [4, 4])
    assert [c.count for c in b.queues[0]] == [8 if targets == [0] else 4]  # one slice, in order


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

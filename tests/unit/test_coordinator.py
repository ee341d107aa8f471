"""Unit tests of ray_ppo.coordinator.actor.Coordinator, driven with asyncio in-process (no Ray).

The coordinator is built inside the event loop of each test (``asyncio.run``), as the Ray async
actor builds it inside its own loop. Prompt feeds read texts given here instead of a dataset; the
state objects it delegates to are tested without asyncio in ``test_coordinator_state.py``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.coordinator.actor import Coordinator
from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.makers.testing import coordinator_config
from ray_ppo.wire.messages import (
    Counters,
    ItemsLost,
    LastPush,
    MakerStats,
    PullOutcome,
    PullReply,
    PullRequest,
    PushHeader,
)
from ray_ppo.wire.transport import ExperienceChunk, resolve

SHORT_S = 0.1  # long enough for any runnable task to run; the blocked ones stay blocked


def item(version: int, uid: str) -> ExperienceItem:
    return ExperienceItem.filled(torch.tensor([3, 4, 5]), torch.tensor([6, 1]), reward=0.5, policy_version=version, uid=uid)


def items(n: int, version: int = 0, prefix: str = "m0") -> ExperienceChunk:
    """A chunk of ``n`` items carried inline (what a maker sends, minus the object store)."""
    return ExperienceChunk.inline([item(version, f"{prefix}-{i}") for i in range(n)])


def uids(reply: PullReply) -> list[str]:
    assert reply.pulled, reply.outcome
    return [it.uid for it in resolve(reply.chunks).items]


def coordinator(data_start: dict | None = None, **quantities) -> Coordinator:
    """A coordinator with the quantities of ``ray_ppo.makers.testing.coordinator_config`` (by default one
    rank, one maker, buffers of 16 items, ``max_staleness`` 1, 8 items per version), no prompts
    until a test gives it a ``feed``."""
    return Coordinator(coordinator_config(**quantities), data_start=data_start)


def counters(coord: Coordinator) -> Counters:
    """The coordinator's counters, after checking the accounting identity."""
    c = coord.status().counters
    assert c.produced == c.consumed + c.in_flight + c.discarded + c.lost_in_transit, c
    return c


def header(version: int, num_chunks: int, nbytes: int = 0) -> PushHeader:
    return PushHeader(version, num_chunks, nbytes, kl_coef=0.05)


NO_STATS = MakerStats()


async def is_blocked(task: asyncio.Task) -> bool:
    done, _ = await asyncio.wait({task}, timeout=SHORT_S)
    return not done


class FakeRemote:
    """Stands in for ``handle.method``: records ``.remote(...)`` calls and returns ``result(...)``."""

    def __init__(self, calls: list, name: str, result=None):
        self.calls, self.name, self.result = calls, name, result

    def remote(self, *args):
        self.calls.append((self.name, *args))
        return self.result(*args) if self.result else None


class FakeMaker:
    """A maker actor handle whose calls are awaitable, as ObjectRefs are."""

    def __init__(self, fail_push: bool = False, dead: bool = False, fail_chunk: bool = False):
        self.calls: list[tuple] = []

        async def ping():
            if dead:
                raise ConnectionError("actor died")
            return True

        async def weights_start(header, relay):
            await asyncio.sleep(0.01)
            self.calls.append(("started", header.version))

        async def weights_chunk(version, index, refs, relay):
            await asyncio.sleep(0.01 * (3 - index))  # later buckets finish first
            if fail_chunk:
                raise ValueError("bucket lost")
            self.calls.append(("staged", version, index))

        async def weights_end(version, relay):
            if fail_push:
                raise ConnectionError("maker died")
            return True

        self.ping = FakeRemote(self.calls, "ping", lambda: ping())
        self.weights_start = FakeRemote(self.calls, "start", weights_start)
        self.weights_chunk = FakeRemote(self.calls, "chunk", weights_chunk)
        self.weights_end = FakeRemote(self.calls, "end", weights_end)

    def sent(self) -> list[tuple]:
        """The calls as the coordinator sent them (without what the fake records as it runs them),
        less the relay number that push calls end with (``relays``)."""
        return [c[:-1] if c[0] in PUSH_CALLS else c for c in self.calls if c[0] not in ("started", "staged")]

    def relays(self) -> list[tuple[str, int]]:
        """(call, relay number) of each push call sent."""
        return [(c[0], c[-1]) for c in self.calls if c[0] in PUSH_CALLS]


PUSH_CALLS = ("start", "chunk", "end")


# -- send and pull ------------------------------------------------------------------------------


def test_a_pull_request_is_built_with_keywords_and_its_outcomes_keep_their_wire_values():
    with pytest.raises(TypeError):
        PullRequest(0, 1, 0, 1.0)  # the positional form is refused
    assert [o.value for o in PullOutcome] == ["pulled", "cancelled", "replaced"]
    assert PullReply().pulled and not PullReply(outcome=PullOutcome.CANCELLED).pulled


def test_send_then_pull_returns_the_items_in_order():
    async def main():
        coord = coordinator()
        stats = MakerStats(num_prompts=3, truncated=2, num_tokens=6, generate_s=0.5)
        assert await coord.send(0, items(3), stats) == 3
        c = counters(coord)
        assert (c.produced, c.in_flight, c.consumed) == (3, 3, 0)
        assert c.truncated_prompts == 2  # blank prompts are those of a batch with no item (prompts by identity, below)
        assert coord.status().makers[0].tokens == 6
        assert coord.status().buffered == (3,)

        got = await coord.pull(PullRequest(rank=0, n=3, trainer_version=0, timeout_s=1.0))
        assert uids(got) == ["m0-0", "m0-1", "m0-2"]
        c = counters(coord)
        assert (c.produced, c.consumed, c.in_flight, c.discarded) == (3, 3, 0, 0)
        assert coord.status().buffered == (0,)

    asyncio.run(main())


def test_send_waits_for_buffer_space():
    async def main():
        coord = coordinator(buffer_size=4)
        send = asyncio.create_task(coord.send(0, items(6), NO_STATS))
        assert await is_blocked(send)
        assert coord.status().buffered == (4,)
        assert counters(coord).in_flight == 6  # 4 buffered + 2 waiting for space

        pull = asyncio.create_task(coord.pull(PullRequest(rank=0, n=4, trainer_version=0, timeout_s=1.0)))
        assert await asyncio.wait_for(send, timeout=1.0) == 6
        assert uids(await pull) == ["m0-0", "m0-1", "m0-2", "m0-3"]
        assert coord.status().buffered == (2,)
        assert uids(await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))) == ["m0-4", "m0-5"]
        c = counters(coord)
        assert (c.produced, c.consumed, c.in_flight) == (6, 6, 0)

    asyncio.run(main())


def test_pull_waits_for_items_to_arrive():
    async def main():
        coord = coordinator()
        pull = asyncio.create_task(coord.pull(PullRequest(rank=0, n=3, trainer_version=0, timeout_s=5.0)))
        await coord.send(0, items(2), NO_STATS)
        assert await is_blocked(pull)
        await coord.send(0, items(2, prefix="late"), NO_STATS)
        assert uids(await asyncio.wait_for(pull, timeout=2.0)) == ["m0-0", "m0-1", "late-0"]
        assert coord.status().buffered == (1,)

    asyncio.run(main())


def test_items_older_than_max_staleness_are_discarded_on_pull():
    async def main():
        coord = coordinator(max_staleness=1)
        for version, names in ((0, ["v0"]), (1, ["v1"]), (2, ["v2a", "v2b"])):  # one chunk per version
            chunk = ExperienceChunk.inline([item(version, name) for name in names])
            assert await coord.send(0, chunk, NO_STATS) == len(names)
        # trainer at version 2, max_staleness 1: the oldest usable version is 1, so "v0" goes
        got = await coord.pull(PullRequest(rank=0, n=2, trainer_version=2, timeout_s=1.0))
        assert uids(got) == ["v1", "v2a"]
        c = counters(coord)
        assert (c.produced, c.consumed, c.in_flight, c.discarded) == (4, 2, 1, 1)
        assert coord.status().trainer_version == 2
        # at version 4 the buffered v2 item is stale too
        with pytest.raises(TimeoutError):
            await coord.pull(PullRequest(rank=0, n=1, trainer_version=4, timeout_s=0.05))
        c = counters(coord)
        assert (c.consumed, c.in_flight, c.discarded) == (2, 0, 2)

    asyncio.run(main())


# -- failures -----------------------------------------------------------------------------------


def test_pull_timeout_reports_what_it_got_and_keeps_the_items():
    async def main():
        coord = coordinator(num_makers=1)
        coord.register_makers({})
        await coord.send(0, items(2), NO_STATS)
        with pytest.raises(TimeoutError) as info:
            await coord.pull(PullRequest(rank=0, n=5, trainer_version=0, timeout_s=0.2))
        message = str(info.value)
        assert "rank 0:" in message
        assert "got 2/5 items" in message
        assert "trainer version 0, max_staleness 1" in message
        assert "makers alive 0/1" in message
        # the partial batch went back to the buffer, in order
        assert coord.status().buffered == (2,)
        assert counters(coord).consumed == 0
        assert uids(await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))) == ["m0-0", "m0-1"]

    asyncio.run(main())


def test_stall_report_pings_the_makers():
    async def main():
        coord = coordinator(num_makers=2)
        coord.register_makers({0: FakeMaker(), 1: FakeMaker(dead=True)})
        coord.state.book.loaded(0, 3)
        with pytest.raises(TimeoutError) as info:
            await coord.pull(PullRequest(rank=0, n=1, trainer_version=3, timeout_s=0.05))
        message = str(info.value)
        assert "got 0/1 items" in message
        assert "makers alive 1/2" in message
        assert message.endswith("maker_0: alive at version 3; maker_1: not answering (ConnectionError)")

    asyncio.run(main())


def test_maker_failure_surfaces_on_the_next_pull():
    async def main():
        coord = coordinator(num_makers=2)
        await coord.send(0, items(3), NO_STATS)
        coord.maker_failed(1, "ValueError: boom", "Traceback (most recent call last):\n  ...\nValueError: boom\n")
        with pytest.raises(RuntimeError) as info:
            await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))
        assert str(info.value) == "maker_1 failed (1/2 makers failed): ValueError: boom"
        assert info.value.origin_traceback.endswith("ValueError: boom\n")  # the maker's, for RUN_DIR/error.log
        assert coord.status().makers[1].failed == "ValueError: boom"
        assert coord.status().buffered == (3,)
        assert counters(coord).consumed == 0

    asyncio.run(main())


def test_maker_failure_wakes_a_waiting_pull_within_its_poll_interval():
    async def main():
        coord = coordinator(num_makers=1)
        pull = asyncio.create_task(coord.pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=30.0)))
        assert await is_blocked(pull)
        coord.maker_failed(0, "killed")
        with pytest.raises(RuntimeError, match="maker_0 failed"):
            await asyncio.wait_for(pull, timeout=3.0)  # pull re-checks at least once a second

    asyncio.run(main())


# -- shutdown -----------------------------------------------------------------------------------


def test_finish_releases_a_blocked_send():
    async def main():
        coord = coordinator(buffer_size=2)
        send = asyncio.create_task(coord.send(0, items(5), NO_STATS))
        assert await is_blocked(send)
        status = await coord.finish()
        assert await asyncio.wait_for(send, timeout=1.0) == 2
        assert status.buffered == (2,)
        c = counters(coord)
        assert (c.produced, c.in_flight) == (5, 5)  # the 3 never buffered stay counted in flight
        assert await coord.send(0, items(1), NO_STATS) == 0
        assert await coord.next_prompts(0) is None  # no dataset needed: a finished run hands out nothing

    asyncio.run(main())


# -- routing ------------------------------------------------------------------------------------


def test_round_robin_by_free_space_fills_the_emptier_rank_first():
    async def main():
        coord = coordinator(num_ranks=2, buffer_size=8, balance="count")
        await coord.send(0, items(6), NO_STATS)
        assert coord.status().buffered == (3, 3,)
        await coord.pull(PullRequest(rank=0, n=3, trainer_version=0, timeout_s=1.0))
        assert coord.status().buffered == (0, 3,)
        await coord.send(0, items(3, prefix="b"), NO_STATS)  # the emptier rank fills first
        assert coord.status().buffered == (3, 3,)
        assert uids(await coord.pull(PullRequest(rank=0, n=3, trainer_version=0, timeout_s=1.0))) == ["b-0", "b-1", "b-2"]

    asyncio.run(main())


def test_a_chunk_is_sliced_across_ranks_and_pulls_without_copying_items():
    async def main():
        coord = coordinator(num_ranks=2, buffer_size=8)
        chunk = items(5)
        await coord.send(0, chunk, NO_STATS)
        assert sorted(coord.status().buffered) == [2, 3]
        first = await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))
        second = await coord.pull(PullRequest(rank=1, n=2, trainer_version=0, timeout_s=1.0))
        assert all(c.payload is chunk.payload for c in first.chunks + second.chunks)  # slices of the one payload
        fuller = max((0, 1), key=lambda r: coord.status().buffered[r])
        rest = await coord.pull(PullRequest(rank=fuller, n=1, trainer_version=0, timeout_s=1.0))
        assert sorted(uids(first) + uids(second) + uids(rest)) == [f"m0-{i}" for i in range(5)]
        c = counters(coord)
        assert (c.produced, c.consumed, c.in_flight) == (5, 5, 0)

    asyncio.run(main())


def test_round_robin_uses_a_free_rank_when_one_is_full():
    async def main():
        coord = coordinator(num_ranks=2, buffer_size=2)
        await coord.send(0, items(2), NO_STATS)
        await coord.pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=1.0))
        await coord.pull(PullRequest(rank=1, n=1, trainer_version=0, timeout_s=1.0))
        assert await asyncio.wait_for(coord.send(0, items(4, prefix="b"), NO_STATS), timeout=1.0) == 4
        assert coord.status().buffered == (2, 2,)

    asyncio.run(main())


def test_modulo_routing_keeps_each_maker_on_its_ranks():
    async def main():
        coord = coordinator(num_ranks=2, num_makers=2, buffer_size=8, routing="modulo")
        await coord.send(1, items(3, prefix="m1"), NO_STATS)
        assert coord.status().buffered == (0, 3,)
        await coord.send(0, items(2), NO_STATS)
        assert coord.status().buffered == (2, 3,)
        assert uids(await coord.pull(PullRequest(rank=1, n=3, trainer_version=0, timeout_s=1.0))) == ["m1-0", "m1-1", "m1-2"]

    asyncio.run(main())


# -- admission ----------------------------------------------------------------------------------


def test_admission_hand_computed():
    async def main():
        # S = 1 version of staleness, 8 items per version, batches of 4 prompts
        coord = coordinator(num_makers=2, buffer_size=32, max_staleness=1, items_per_version=8, prompt_batch_size=4)
        # V = 0, maker v = 0: capacity = (0 + 1 - 0 + 1) * 8 - 0 = 16
        assert coord.state.admitted(0)                    # 0 + 0 + 4 <= 16
        await coord.send(0, items(8), NO_STATS)      # in_flight = 8
        coord.state.admission.reserved[0] = 4              # one batch handed out, not yet sent back
        assert coord.state.admitted(0)                    # 8 + 4 + 4 = 16 <= 16
        coord.state.admission.reserved[0] = 5
        assert not coord.state.admitted(0)                # 17 > 16

        # V = 1, consumed_at_version = 8, in_flight = 0
        await coord.pull(PullRequest(rank=0, n=8, trainer_version=1, timeout_s=1.0))
        coord.state.admission.reserved[0] = 0
        # maker 0 still at v = 0: capacity = (0 + 1 - 1 + 1) * 8 - 8 = 0
        assert not coord.state.admitted(0)                # 0 + 0 + 4 > 0
        coord.state.book.loaded(1, 1)                      # maker 1 loaded v1: capacity = (1 + 1 - 1 + 1) * 8 - 8 = 8
        coord.state.admission.reserved[0] = 4
        assert coord.state.admitted(1)                    # 0 + 4 + 4 = 8 <= 8
        coord.state.admission.reserved[0] = 5
        assert not coord.state.admitted(1)                # 9 > 8

        coord.state.admission.reserved[0] = 0
        await coord.pull(PullRequest(rank=0, n=0, trainer_version=3, timeout_s=1.0))  # V = 3 resets consumed_at_version to 0
        assert not coord.state.admitted(1)                # v = 1: (1 + 1 - 3 + 1) * 8 - 0 = 0 < 4
        coord.state.book.loaded(1, 2)
        assert coord.state.admitted(1)                    # v = 2: (2 + 1 - 3 + 1) * 8 = 8 >= 4

    asyncio.run(main())


def test_a_rank_finishing_the_previous_step_does_not_use_up_the_new_versions_admission():
    """Two ranks: rank 0 pushed version 1 while rank 1 was still pulling its step-0 batch. Those
    items belong to version 0's budget; counting them against version 1 would hold every maker at
    admission until the push landed (measured by overlap_sim.py with 2 ranks)."""
    async def main():
        coord = coordinator(num_ranks=2, num_makers=1, buffer_size=32, max_staleness=1, items_per_version=8,
                            prompt_batch_size=4)
        await coord.send(0, items(4), NO_STATS)                    # routed 2 + 2
        await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))  # rank 0's step-0 batch
        await coord.publish_weights(header(1, 0), [])              # rank 0 pushed v1: V = 1
        coord.state.book.loaded(0, 1)                                    # the maker loaded it
        await coord.pull(PullRequest(rank=1, n=2, trainer_version=0, timeout_s=1.0))  # rank 1 finishes its step-0 pull late
        assert coord.state.admission.consumed_at_version == 0
        # v = 1, V = 1: capacity = (1 + 1 - 1 + 1) * 8 - 0 = 16; in flight 0 -> admitted for 4 batches
        coord.state.admission.reserved[0] = 12
        assert coord.state.admitted(0)                                  # 0 + 12 + 4 <= 16

    asyncio.run(main())


# -- pulling ahead (trainer.prefetch) -----------------------------------------------------------


def test_a_pull_ahead_drops_what_is_too_stale_for_the_version_it_trains_at():
    async def main():
        coord = coordinator(max_staleness=1)
        for version, name in ((0, "v0"), (1, "v1"), (2, "v2")):
            await coord.send(0, ExperienceChunk.inline([item(version, name)]), NO_STATS)
        # the rank is at version 1 and pulls for its next step, which trains at version 2:
        # version 0 would be 2 versions stale there, so it goes, though version 1 still allows it
        got = await coord.pull(PullRequest(rank=0, n=1, trainer_version=1, timeout_s=1.0, for_version=2))
        assert uids(got) == ["v1"]
        assert coord.status().trainer_version == 1  # a pull ahead does not move the trainer's version
        c = counters(coord)
        assert (c.consumed, c.in_flight, c.discarded) == (1, 1, 1)

    asyncio.run(main())


def test_a_pull_ahead_uses_up_admission_of_the_version_it_trains_at():
    async def main():
        # S = 1, 8 items per version, batches of 4 prompts, one maker
        coord = coordinator(num_makers=1, buffer_size=32, max_staleness=1, items_per_version=8, prompt_batch_size=4)
        await coord.send(0, items(16), NO_STATS)
        await coord.pull(PullRequest(rank=0, n=8, trainer_version=0, timeout_s=1.0))                 # step 1, at version 0
        await coord.pull(PullRequest(rank=0, n=8, trainer_version=0, timeout_s=1.0, for_version=1))  # step 2's, sent ahead
        assert (coord.state.admission.consumed_at_version, coord.state.admission.ahead) == (8, {1: 8})
        # maker at v = 0, V = 0: capacity = (0 + 1 - 0 + 1) * 8 - 8 - 8 = 0: the 16 items are all
        # the trainer takes before v0 is too stale
        assert not coord.state.admitted(0)
        await coord.publish_weights(header(1, 0), [])  # step 1 pushed v1: step 2's items count at V = 1
        assert (coord.state.admission.consumed_at_version, coord.state.admission.ahead) == (8, {})
        coord.state.book.loaded(0, 1)                        # v = 1: capacity = (1 + 1 - 1 + 1) * 8 - 8 = 8
        coord.state.admission.reserved[0] = 4
        assert coord.state.admitted(0)                      # 0 + 4 + 4 <= 8
        coord.state.admission.reserved[0] = 5
        assert not coord.state.admitted(0)                  # 9 > 8

    asyncio.run(main())


def test_a_restarted_worker_group_gets_the_admission_its_dead_predecessor_used_up():
    """A worker group pulls its step's items at the trainer's version and the next step's ahead,
    then dies before it pushes; its successor restarts from a checkpoint at that same version
    (the makers hold it already, so the version does not move). The dead group trained none of
    those items (their prompts are served again), so the makers must be admitted for the new
    group's: before, they waited for ever and the run ended with 'no complete batch for 60 s ...
    makers alive 2/2' (seen in tests/ray/test_faults.py, a maker and a rank killed in one run)."""
    async def main():
        coord = coordinator(num_makers=1, buffer_size=32, max_staleness=1, items_per_version=8, prompt_batch_size=4,
                            shuffle=False)
        feed(coord, [f"p{i}" for i in range(64)])
        first = await coord.rewind(0)
        for _ in range(4):
            batch = await coord.next_prompts(0)
            await coord.send(0, answering(batch.ids, version=0), MakerStats(num_prompts=4, prompt_ids=tuple(batch.ids)))
        await coord.pull(PullRequest(rank=0, n=8, trainer_version=0, timeout_s=1.0, pid=7, step=1, group=first))
        await coord.pull(PullRequest(rank=0, n=8, trainer_version=0, timeout_s=1.0, pid=7, step=2, for_version=1, group=first))
        # S = 1, v = V = 0: capacity (0 + 1 - 0 + 1) * 8 - 8 - 8 = 0, all taken by the group that now dies
        waiting = asyncio.create_task(coord.next_prompts(0))
        assert await is_blocked(waiting)
        waiting.cancel()
        await coord.rewind(0)  # its successor's rank 0, restarting from step 0 at version 0
        batch = await asyncio.wait_for(coord.next_prompts(0), timeout=2.0)
        assert batch.ids == [0, 1, 2, 3]  # the dead group's prompts come first, served again

    asyncio.run(main())


def test_a_cancelled_pull_ahead_puts_back_what_it_took_and_returns_none():
    async def main():
        coord = coordinator()
        await coord.cancel_pull(0, pid=7)  # no pull in progress: nothing to cancel, and the next pull is not affected
        await coord.send(0, items(2), NO_STATS)
        pull = asyncio.create_task(coord.pull(PullRequest(rank=0, n=5, trainer_version=0, timeout_s=5.0, pid=7, for_version=1)))
        assert await is_blocked(pull)
        await coord.cancel_pull(0, pid=8)  # another process's pull (a restarted worker group's)
        assert await is_blocked(pull)
        await coord.cancel_pull(0, pid=7)
        assert (await asyncio.wait_for(pull, timeout=2.0)).outcome is PullOutcome.CANCELLED
        assert coord.status().buffered == (2,) and coord.state.admission.ahead == {}
        assert counters(coord).consumed == 0
        assert uids(await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0))) == ["m0-0", "m0-1"]

    asyncio.run(main())


def test_a_rewind_cancels_the_pulls_of_the_worker_group_that_died():
    async def main():
        coord = coordinator()
        dead = asyncio.create_task(coord.pull(PullRequest(rank=0, n=4, trainer_version=0, timeout_s=5.0, pid=7, step=5,
                                                          for_version=1)))
        assert await is_blocked(dead)
        await coord.rewind(3)  # the restarted group's rank 0, before any of its ranks pulls
        assert (await asyncio.wait_for(dead, timeout=2.0)).outcome is PullOutcome.CANCELLED
        await coord.send(0, items(4), NO_STATS)  # what the dead pull would have taken goes to the new group
        got = await coord.pull(PullRequest(rank=0, n=4, trainer_version=0, timeout_s=1.0, pid=8, step=4))
        assert uids(got) == [f"m0-{i}" for i in range(4)]

    asyncio.run(main())


def test_a_pull_of_a_replaced_worker_group_arriving_after_the_rewind_takes_nothing():
    async def main():
        coord = coordinator()
        first = await coord.rewind(0)   # the first worker group starts
        await coord.send(0, items(4), NO_STATS)
        got = await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, pid=7, step=1, group=first))
        assert uids(got) == ["m0-0", "m0-1"]
        second = await coord.rewind(0)  # it died; the restarted group's rank 0
        assert second == first + 1
        # the dead rank's pull, sent before it died, arrives now: refused at once, nothing taken
        late = PullRequest(rank=0, n=2, trainer_version=0, timeout_s=5.0, pid=7, step=2, group=first)
        refused = await asyncio.wait_for(coord.pull(late), timeout=1.0)
        assert (refused.outcome, refused.chunks) == (PullOutcome.REPLACED, [])
        assert coord.status().buffered == (2,) and counters(coord).consumed == 2
        got = await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, pid=8, step=1, group=second))
        assert uids(got) == ["m0-2", "m0-3"]

    asyncio.run(main())


def test_a_pull_ahead_handed_back_is_buffered_again_and_its_prompts_are_not_trained():
    async def main():
        coord = coordinator(num_makers=1, prompt_batch_size=4, items_per_version=8, max_staleness=1, shuffle=False)
        feed(coord, [f"p{i}" for i in range(8)])
        batch = await coord.next_prompts(0)
        await coord.send(0, answering(batch.ids), MakerStats(num_prompts=4, prompt_ids=tuple(batch.ids)))
        await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=1))
        ahead = await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=2, for_version=1))
        assert uids(ahead) == ["u2", "u3"] and coord.status().counters.prompts_trained == 4
        await coord.hand_back(0, ahead.chunks, for_version=1)  # step 1 was the run's last
        c = counters(coord)
        assert (c.consumed, c.in_flight, c.prompts_trained) == (2, 2, 2)
        assert coord.state.admission.ahead == {} and coord.data_state(step=1)["trained"] == [[1, [0, 1]]]
        got = await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=2))  # the same items, in order
        assert uids(got) == ["u2", "u3"] and coord.status().counters.prompts_trained == 4

    asyncio.run(main())


def test_a_steps_counters_count_the_prompts_trained_by_it_and_go_on_after_a_resume():
    """Step s's metrics row is read while step s + 1's pull ahead is answered: its prompts_trained
    counts the prompts trained at steps up to s. A coordinator resumed from the checkpoint of a
    step goes on from the run's prompt counts at it."""
    async def main():
        coord = coordinator(num_makers=1, prompt_batch_size=4, items_per_version=8, max_staleness=1, shuffle=False)
        feed(coord, ["", "p1", "p2", "p3", "p4", "p5", "p6", "p7"])
        batch = await coord.next_prompts(0)
        await coord.send(0, answering(batch.ids[1:]), MakerStats(num_prompts=4, prompt_ids=tuple(batch.ids),
                                                                  blank=1, truncated=2))
        await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=1))
        # ahead, while step 1 trains
        await coord.pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=1.0, step=2, for_version=1))
        assert [coord.status(step).counters.prompts_trained for step in (1, 2)] == [2, 3]
        c = coord.status(1).counters
        assert (c.prompts_served, c.blank_prompts, c.truncated_prompts, c.lost) == (4, 1, 2, 0)

        resumed = coordinator(num_makers=1, prompt_batch_size=4, items_per_version=8, max_staleness=1,
                              data_start=coord.data_state(step=1))
        feed(resumed, ["", "p1", "p2", "p3", "p4", "p5", "p6", "p7"])
        c = resumed.status(1).counters
        assert (c.prompts_trained, c.prompts_served, c.blank_prompts, c.truncated_prompts) == (2, 4, 1, 2)
        batch = await resumed.next_prompts(0)
        assert batch.ids == [3, 4, 5, 6]  # prompt 3, trained after step 1, is trained again
        await resumed.send(0, answering(batch.ids), MakerStats(num_prompts=4, prompt_ids=tuple(batch.ids)))
        await resumed.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=2))
        assert (resumed.status(2).counters.prompts_trained, resumed.status(2).counters.prompts_served) == (4, 8)

    asyncio.run(main())


def test_send_returns_the_reserved_prompts():
    async def main():
        coord = coordinator(prompt_batch_size=4)
        coord.state.admission.reserved[0] = 8  # two batches of 4 prompts handed out
        await coord.send(0, items(3), MakerStats(num_prompts=4))  # one prompt was blank: 3 items for 4 prompts
        assert coord.state.admission.total_reserved == 4

    asyncio.run(main())


def feed(coord: Coordinator, texts: list[str], gate: threading.Event | None = None) -> PromptFeed:
    """A prompt feed over ``texts`` (its read waits for ``gate``, if given), as the coordinator's."""
    def read() -> list[str]:
        if gate is not None:
            gate.wait(timeout=5.0)
        return list(texts)

    coord.state.feed = PromptFeed(read, coord.state.ledger)
    return coord.state.feed


def test_a_restart_ends_the_dead_callers_waiting_next_prompts():
    async def main():
        coord = coordinator(prompt_batch_size=4)
        coord.state.admission.trainer_version = 5  # maker 0 at version 0 is far too stale: not admitted
        waiting = asyncio.create_task(coord.next_prompts(0))
        assert await is_blocked(waiting)
        await coord.maker_restarted(0)  # the caller died while waiting: it gets nothing
        assert await asyncio.wait_for(waiting, 1.0) is None
        assert coord.state.admission.total_reserved == 0 and counters(coord).lost == 0

    asyncio.run(main())


def test_a_batch_read_for_a_maker_that_restarted_meanwhile_is_counted_lost_and_served_again():
    async def main():
        coord = coordinator(prompt_batch_size=4, shuffle=False)
        gate = threading.Event()
        feed(coord, ["a", "b", "c", "d", "e", "f"], gate)
        reading = asyncio.create_task(coord.next_prompts(0))
        assert await is_blocked(reading)  # the texts are being read (in a worker thread)
        assert coord.status().makers[0].reserved == 4
        await coord.maker_restarted(0)
        gate.set()
        assert await asyncio.wait_for(reading, 2.0) is None
        c = counters(coord)
        assert (c.prompts_served, c.lost, coord.status().makers[0].reserved) == (4, 4, 0)
        assert c.prompts_requeued == 4  # given back to the ledger
        batch = await coord.next_prompts(0)  # the restarted maker's own calls are served: the same prompts
        assert (batch.prompts, batch.ids) == (["a", "b", "c", "d"], [0, 1, 2, 3])
        assert coord.status().makers[0].reserved == 4

    asyncio.run(main())


# -- weights ------------------------------------------------------------------------------------


def test_publish_weights_relays_the_buckets_in_order_and_tracks_versions():
    async def main():
        coord = coordinator(num_makers=2)
        makers = {0: FakeMaker(), 1: FakeMaker()}
        coord.register_makers(makers)
        push = header(1, 2, nbytes=128)
        await coord.publish_weights(push, ["ref-a", "ref-b"])
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1, 1: 1}
        for maker in makers.values():
            assert maker.sent() == [("start", push), ("chunk", 1, 0, ["ref-a"]),
                                   ("chunk", 1, 1, ["ref-b"]), ("end", 1)]
        status = coord.status()
        assert status.trainer_version == 1
        assert (status.pushes, status.last_push) == (1, LastPush(1, 128))

    asyncio.run(main())


def test_each_bucket_is_relayed_as_soon_as_rank_0_hands_it_in():
    async def main():
        coord = coordinator(num_makers=1)
        maker = FakeMaker()
        coord.register_makers({0: maker})
        await coord.publish_start(header(1, 3))
        await asyncio.sleep(SHORT_S)
        assert maker.sent() == [("start", header(1, 3))] and coord.status().trainer_version == 1
        await coord.publish_chunk(1, 0, ["ref-a"])
        await asyncio.sleep(SHORT_S)  # bucket 0 reaches the maker before bucket 1 is even put
        assert maker.sent()[-1] == ("chunk", 1, 0, ["ref-a"])
        await coord.publish_chunk(1, 2, ["ref-c"])  # out of order: held until bucket 1 is in
        await asyncio.sleep(SHORT_S)
        assert maker.sent()[-1] == ("chunk", 1, 0, ["ref-a"])
        await coord.publish_chunk(1, 1, ["ref-b"])
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1}
        assert maker.sent()[1:] == [("chunk", 1, 0, ["ref-a"]), ("chunk", 1, 1, ["ref-b"]),
                                   ("chunk", 1, 2, ["ref-c"]), ("end", 1)]

    asyncio.run(main())


def test_a_push_interrupted_midway_is_never_ended_and_the_next_one_completes():
    """Rank 0 died after bucket 0 of push 1: the relay waits, then gives push 1 up when push 2
    starts; the maker gets no chunk_end for push 1 (it keeps its weights) and loads push 2."""
    async def main():
        coord = coordinator(num_makers=1)
        maker = FakeMaker()
        coord.register_makers({0: maker})
        await coord.publish_start(header(1, 2))
        await coord.publish_chunk(1, 0, ["old-a"])
        assert await coord.wait_for_version(1, timeout_s=SHORT_S) == {0: 0}
        await coord.publish_weights(header(2, 2), ["new-a", "new-b"])
        await coord.publish_chunk(1, 1, ["old-b"])  # a late bucket of the abandoned push: ignored
        assert await coord.wait_for_version(2, timeout_s=1.0) == {0: 2}
        await asyncio.sleep(SHORT_S)
        assert ("end", 1) not in maker.sent() and ("chunk", 1, 1, ["old-b"]) not in maker.sent()
        assert maker.sent()[-4:] == [("start", header(2, 2)), ("chunk", 2, 0, ["new-a"]), ("chunk", 2, 1, ["new-b"]), ("end", 2)]
        assert not coord.push_tasks  # no relay left waiting

    asyncio.run(main())


def test_rank_0_sends_a_metrics_row_only_after_the_previous_one_is_in(monkeypatch):
    """The coordinator may run one caller's calls out of order (an async actor), so rank 0 sends
    each step's row once the previous step's call is done: rows land in step order."""
    from types import SimpleNamespace

    from ray_ppo.train import loop

    events = []

    class RecordMetrics:
        def remote(self, row):
            events.append(("send", row["step"]))
            return f"ref{row['step']}"

    monkeypatch.setattr(loop.ray, "get", lambda ref: events.append(("wait", ref)))
    rows = loop._Rows(SimpleNamespace(record_metrics=RecordMetrics()))
    for step in (1, 2, 3):
        rows.record({"step": step})
    assert events == [("send", 1), ("wait", "ref1"), ("send", 2), ("wait", "ref2"), ("send", 3)]


def test_a_push_whose_buckets_run_before_its_start_still_reaches_the_maker():
    """Ray may run an async actor's calls out of the order one caller sent them: rank 0's
    publish_chunk can run before its publish_start."""
    async def main():
        coord = coordinator(num_makers=1)
        maker = FakeMaker()
        coord.register_makers({0: maker})
        await coord.publish_chunk(1, 1, ["ref-b"])
        await coord.publish_start(header(1, 2))
        await coord.publish_chunk(1, 0, ["ref-a"])
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1}
        assert maker.sent()[-1] == ("end", 1)
        assert sorted(c for c in maker.sent() if c[0] == "chunk") == [("chunk", 1, 0, ["ref-a"]), ("chunk", 1, 1, ["ref-b"])]

    asyncio.run(main())


def test_a_restarted_maker_gets_the_latest_push_again():
    async def main():
        coord = coordinator(num_makers=1)
        maker = FakeMaker()
        coord.register_makers({0: maker})
        await coord.publish_weights(header(1, 1), ["ref-a"])
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1}
        await coord.maker_restarted(0)
        assert coord.state.book.states[0].version == 0
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1}
        assert maker.sent()[-3:] == [("start", header(1, 1)), ("chunk", 1, 0, ["ref-a"]), ("end", 1)]
        # the resend is a relay of its own: its calls carry a later number than the first relay's,
        # so the first relay's calls that Ray retries on the new process leave it alone
        assert maker.relays() == [("start", 1), ("chunk", 1), ("end", 1), ("start", 2), ("chunk", 2), ("end", 2)]

    asyncio.run(main())


def test_a_push_sends_chunks_after_start_and_end_after_every_chunk_ran():
    """A threaded actor may run one caller's calls out of order: the relay waits for chunk_start
    to run before sending chunks, and for every chunk before chunk_end."""
    async def main():
        coord = coordinator(num_makers=1)
        maker = FakeMaker()
        coord.register_makers({0: maker})
        await coord.publish_weights(header(1, 3), ["a", "b", "c"])
        assert await coord.wait_for_version(1, timeout_s=1.0) == {0: 1}
        events = [c[0] for c in maker.calls]
        assert events.index("started") < events.index("chunk")
        assert events.index("end") > max(i for i, e in enumerate(events) if e == "staged")
        assert events.count("staged") == 3

    asyncio.run(main())


def test_a_chunk_that_fails_fails_the_push_instead_of_leaving_the_maker_behind():
    async def main():
        coord = coordinator(num_makers=2)
        coord.register_makers({0: FakeMaker(), 1: FakeMaker(fail_chunk=True)})
        await coord.publish_weights(header(2, 2), ["a", "b"])
        assert await coord.wait_for_version(2, timeout_s=1.0) == {0: 2, 1: 0}
        with pytest.raises(RuntimeError, match="maker_1 failed .*weight push v2 failed: ValueError: bucket lost"):
            await coord.pull(PullRequest(rank=0, n=1, trainer_version=2, timeout_s=1.0))

    asyncio.run(main())


def test_a_failed_weight_push_fails_the_maker():
    async def main():
        coord = coordinator(num_makers=2)
        coord.register_makers({0: FakeMaker(), 1: FakeMaker(fail_push=True)})
        await coord.publish_weights(header(2, 1), ["ref"])
        assert await coord.wait_for_version(2, timeout_s=1.0) == {0: 2, 1: 0}
        with pytest.raises(RuntimeError, match="maker_1 failed .*weight push v2 failed: ConnectionError: maker died"):
            await coord.pull(PullRequest(rank=0, n=1, trainer_version=2, timeout_s=1.0))

    asyncio.run(main())


# -- prompts by identity (ray_ppo.coordinator.ledger) ------------------------------------------------------


def answering(ids: list[int], version: int = 0) -> ExperienceChunk:
    """One item per prompt id, as a maker sends them."""
    made = [item(version, f"u{pid}") for pid in ids]
    for it, pid in zip(made, ids):
        it.prompt_id = pid
    return ExperienceChunk.inline(made)


def test_the_coordinator_follows_prompts_by_identity_until_trained():
    async def main():
        coord = coordinator(num_makers=2, prompt_batch_size=2, items_per_version=8, max_staleness=1, shuffle=False)
        feed(coord, [f"p{i}" for i in range(6)])
        a, b = await coord.next_prompts(0), await coord.next_prompts(1)
        assert (a.ids, b.ids, a.prompts) == ([0, 1], [2, 3], ["p0", "p1"])
        await coord.send(1, answering([2]), MakerStats(num_prompts=2, prompt_ids=(2, 3)))  # prompt 3 was blank
        await coord.send(0, answering([0, 1]), MakerStats(num_prompts=2, prompt_ids=(0, 1)))
        await coord.pull(PullRequest(rank=0, n=2, trainer_version=0, timeout_s=1.0, step=1))  # prompts 2 and 0, in arrival order
        state = coord.data_state(step=1)
        assert state["trained"] == [[1, [2, 0]]] and (state["watermark"], state["next"], state["done"]) == (1, 4, [2, 3])
        await coord.pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=1.0, step=2))
        assert coord.data_state(step=1)["watermark"] == 1  # prompt 1 was trained after step 1's checkpoint
        assert coord.data_state(step=2)["watermark"] == 4
        assert coord.status().counters.prompts_trained == 3

    asyncio.run(main())


def test_stale_lost_and_rewound_prompts_are_served_again():
    async def main():
        coord = coordinator(num_makers=2, prompt_batch_size=2, items_per_version=8, max_staleness=1, shuffle=False)
        feed(coord, [f"p{i}" for i in range(10)])
        await coord.next_prompts(0)                       # 0, 1
        await coord.next_prompts(1)                       # 2, 3: maker 1 dies holding them
        await coord.send(0, answering([0, 1], version=0), MakerStats(num_prompts=2, prompt_ids=(0, 1)))
        await coord.maker_restarted(1)
        await coord.pull(PullRequest(rank=0, n=0, trainer_version=2, timeout_s=1.0))  # items of version 0 are too stale now
        coord.state.book.loaded(0, 2)  # maker 0 loaded the new weights: admitted again
        assert coord.status().counters.discarded == 2
        assert (await coord.next_prompts(0)).ids == [2, 3]   # the lost ones first ...
        assert (await coord.next_prompts(0)).ids == [0, 1]   # ... then the discarded ones
        await coord.send(0, answering([2, 3], version=2), MakerStats(num_prompts=2, prompt_ids=(2, 3)))
        await coord.pull(PullRequest(rank=0, n=2, trainer_version=2, timeout_s=1.0, step=1))
        await coord.rewind(0)                                # a restarted worker group redoes step 1
        assert coord.status().counters.prompts_requeued == 2 + 2 + 2
        assert (await coord.next_prompts(0)).ids == [2, 3]
        await coord.lost_in_transit(ItemsLost(0, 1, (7,)))          # an id it never handed out: ignored
        assert coord.status().counters.prompts_requeued == 2 + 2 + 2

    asyncio.run(main())


def test_a_bucket_lost_with_its_owner_drops_the_push_and_keeps_the_weights(monkeypatch):
    """Trainer rank 0 died after putting a bucket (a FailureConfig restart): the maker's fetch
    fails with OwnerDiedError. The push is dropped (end says incomplete), nothing is raised to
    the relay (which would fail the maker), and the next push stages normally."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    def fetch(refs):  # as fetch_objects answers: None for an object lost with its owner
        return {ref: None if ref == "lost" else ("bucket", ref) for ref in refs}

    received = WeightReceiver(fetch)
    received.start(header(1, 2), None)
    received.chunk(1, 0, ["lost"])
    received.chunk(1, 1, ["fine"])
    assert received.end(1) is None  # incomplete: the caller's swap never happens
    received.start(header(2, 1), None)
    staged = []
    def add(self, index, bucket):
        staged.append(bucket)
        self.seen.add(index)

    monkeypatch.setattr(receiver_module.StagedPush, "add", add)
    received.chunk(2, 0, ["fine"])
    assert received.end(2) is not None and staged == [("bucket", "fine")]


def held(refs):
    """A fetch for buckets passed by value."""
    return {ref: ref for ref in refs}


def test_a_late_end_of_an_older_push_keeps_the_newer_push_staged(monkeypatch):
    """chunk_end of push 3, run after push 4's chunk_start (two relays to one maker overlapping),
    says 'not loaded' and leaves push 4's staging alone (CI: 'maker_0 still holds v3')."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    monkeypatch.setattr(receiver_module.StagedPush, "add", lambda self, index, bucket: self.seen.add(index))
    received = WeightReceiver(held)
    received.start(header(3, 1), None)
    received.chunk(3, 0, ["b3"])
    received.start(header(4, 1), None)
    assert received.end(3) is None
    received.chunk(4, 0, ["b4"])
    done = received.end(4)
    assert done is not None and done[0].version == 4


def test_a_late_start_of_an_older_push_leaves_the_newer_push_staged(monkeypatch):
    """Push 4's chunk_start run after push 5's (the relays of two pushes are independent calls,
    which a threaded actor may run out of order) is ignored: push 5 still loads. Before, it
    replaced push 5's staging, push 5's end said 'not loaded', and the maker stayed on v3 while
    the trainer, at v5, waited for experience only v4 or later could make (peer_trl.py's
    detached run: 'no complete batch for 120 s ... maker_0: alive at version 3')."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    monkeypatch.setattr(receiver_module.StagedPush, "add", lambda self, index, bucket: self.seen.add(index))
    received = WeightReceiver(held)
    assert received.start(header(5, 1), None, loaded_version=3)
    assert not received.start(header(4, 1), None, loaded_version=3)  # late: push 5 is staging
    received.chunk(4, 0, ["b4"])
    assert received.end(4) is None
    received.chunk(5, 0, ["b5"])
    done = received.end(5)
    assert done is not None and done[0].version == 5


def test_a_start_older_than_the_loaded_weights_is_ignored_and_an_equal_one_is_not(monkeypatch):
    """After push 5 loaded, a late push 4 must not take the maker back (its chunk_end would load
    it); a push of the version held (the first push, v0, of a run that waits for weights) stages."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    monkeypatch.setattr(receiver_module.StagedPush, "add", lambda self, index, bucket: self.seen.add(index))
    received = WeightReceiver(held)
    assert not received.start(header(4, 1), None, loaded_version=5)
    received.chunk(4, 0, ["b4"])
    assert received.end(4) is None
    assert received.start(header(0, 1), None, loaded_version=0)
    received.chunk(0, 0, ["b0"])
    assert received.end(0) is not None


def test_two_relays_of_one_push_to_a_restarted_maker_load_it_whatever_their_order(monkeypatch):
    """A maker died while push 6 was relayed to it. Ray retries the relay's calls on the restarted
    process (the maker's methods have ``max_task_retries=-1``), and the coordinator relays the
    latest push, 6 again, to the restarted maker. The old relay's retried chunk_end, run after
    the new relay's chunk_start, once dropped the new relay's staging (same version): the maker
    stayed on its initial weights, and the run ended 'no complete batch for 120 s ... maker_0:
    alive at version 0' (tests/cluster/test_node_failures.py). Each relay now stages under its
    own number, and the calls of an older relay leave a newer one's staging alone."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    monkeypatch.setattr(receiver_module.StagedPush, "add", lambda self, index, bucket: self.seen.add(index))
    old, new = 1, 2
    for stale_calls in (["end"], ["start", "end"], ["start", "chunk", "end"]):
        received = WeightReceiver(held)
        assert received.start(header(6, 2), None, loaded_version=0, relay=new)
        received.chunk(6, 0, ["b0"], relay=new)
        for call in stale_calls:  # the old relay's retried calls, between the new relay's
            if call == "start":
                assert not received.start(header(6, 2), None, loaded_version=0, relay=old)
            elif call == "chunk":
                received.chunk(6, 1, ["b1"], relay=old)
            else:
                assert received.end(6, relay=old) is None
        received.chunk(6, 1, ["b1"], relay=new)
        done = received.end(6, relay=new)
        assert done is not None and done[0].version == 6, stale_calls


def test_a_repeated_start_of_one_relay_keeps_what_it_staged(monkeypatch):
    """A call Ray retries on the same process (the actor was briefly unreachable: the call 'may or
    may not have been executed') runs twice: chunk_start again must not drop the staged buckets."""
    from ray_ppo.makers import receiver as receiver_module
    from ray_ppo.makers.receiver import WeightReceiver

    monkeypatch.setattr(receiver_module.StagedPush, "add", lambda self, index, bucket: self.seen.add(index))
    received = WeightReceiver(held)
    assert received.start(header(2, 2), None, relay=7)
    received.chunk(2, 0, ["b0"], relay=7)
    assert received.start(header(2, 2), None, relay=7)
    received.chunk(2, 1, ["b1"], relay=7)
    assert received.end(2, relay=7) is not None

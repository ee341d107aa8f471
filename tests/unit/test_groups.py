"""Groups (the ``maker.samples_per_prompt`` responses to one prompt) are never split: not by a
chunk cut, not across ranks by routing, not across training steps by a pull."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from ray_ppo.config import Config, ConfigError
from ray_ppo.wire.messages import MakerStats, PullRequest
from ray_ppo.wire.transport import ExperienceChunk, resolve
from tests.unit.test_coordinator import coordinator, counters, item


def grouped_chunk(num_groups: int, group_size: int, maker: str) -> ExperienceChunk:
    """uids "<maker>-g<group>-<member>", laid out group after group as a maker makes them."""
    its = [item(0, f"{maker}-g{g}-{k}") for g in range(num_groups) for k in range(group_size)]
    return ExperienceChunk.of(its, "inline", group_size=group_size)


def group_of(uid: str) -> str:
    return uid.rsplit("-", 1)[0]


def test_chunk_cut_inside_a_group_is_refused():
    chunk = grouped_chunk(3, 4, "m0")
    head, rest = chunk.split(8)
    assert (head.count, rest.count, rest.group_size) == (8, 4, 4)
    with pytest.raises(ValueError, match="groups of 4 would be split"):
        chunk.split(6)
    with pytest.raises(ValueError, match="whole groups of 4"):
        ExperienceChunk.of([item(0, str(i)) for i in range(6)], "inline", group_size=4)


@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_groups_stay_whole_on_one_rank_and_in_one_pull(group_size):
    """Three makers send odd numbers of groups to three ranks whose buffers fill and drain
    unevenly; every pulled batch holds whole groups, and each group lands on one rank only."""
    async def run():
        n = group_size
        coord = coordinator(num_ranks=3, num_makers=3, buffer_size=4 * n, items_per_version=12 * n)
        sends = [asyncio.create_task(coord.send(m, grouped_chunk(g, n, f"m{m}"), MakerStats()))
                 for m, g in zip(range(3), (5, 3, 7))]
        seen: dict[str, set[int]] = {}
        pulled = 0
        for rank in itertools.islice(itertools.cycle(range(3)), 100):
            if pulled == 15 * n:
                break
            status = coord.status().buffered
            if status[rank] < 2 * n:
                await asyncio.sleep(0)
                continue
            out = resolve((await coord.pull(PullRequest(rank=rank, n=2 * n, trainer_version=0, timeout_s=1.0))).chunks).items
            pulled += len(out)
            groups = [group_of(it.uid) for it in out]
            for g in set(groups):
                assert groups.count(g) == n, f"group {g} split within a pull: {groups}"
                seen.setdefault(g, set()).add(rank)
        await asyncio.gather(*sends)
        assert all(len(ranks) == 1 for ranks in seen.values()), seen
        assert counters(coord).produced == 15 * n
    asyncio.run(run())


def test_config_keeps_groups_whole():
    base = Config().with_overrides({"maker.samples_per_prompt": 4})
    with pytest.raises(ConfigError, match="trainer.train_batch_size=30 is not a multiple of maker.samples_per_prompt=4"):
        base.with_overrides({"trainer.train_batch_size": 30, "trainer.mini_batch_size": 15})
    with pytest.raises(ConfigError, match="topology.buffer_size=66"):
        base.with_overrides({"topology.buffer_size": 66})
    with pytest.raises(ConfigError, match="needs maker.samples_per_prompt >= 2"):
        Config().with_overrides({"algo.advantage": "rloo"})
    with pytest.raises(ConfigError, match="no maker would ever be admitted"):
        base.with_overrides({"maker.batch_size": 32, "ppo.max_staleness": 0})
    assert base.with_overrides({"algo.advantage": "grpo"}).algo.advantage == "grpo"

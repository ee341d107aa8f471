"""Unit tests of ray_ppo.wire.transport: experience chunks, in-process (inline payloads, no Ray)."""

import numpy as np
import pytest
import torch

from ray_ppo.algo import ExperienceItem, PackedItems
from ray_ppo.wire.transport import ExperienceChunk, resolve


def item(uid: str, version: int = 3, n: int = 2) -> ExperienceItem:
    return ExperienceItem.filled(torch.tensor([1, 2]), torch.arange(n), lambda name: torch.full((n,), float(name == "values")),
                                 reward=0.1, policy_version=version, uid=uid)


def test_split_chunks_resolve_to_the_original_items_in_order():
    chunk = ExperienceChunk.inline([item(f"u{i}", n=i + 1) for i in range(5)])
    assert (chunk.count, chunk.policy_version) == (5, 3)
    head, rest = chunk.split(2)
    first, last = rest.split(1)
    assert (head.count, first.count, last.count) == (2, 1, 2)
    got, lost, _ = resolve([head, first, last])
    assert lost == 0
    assert [it.uid for it in got] == ["u0", "u1", "u2", "u3", "u4"]
    assert [it.response_length for it in got] == [1, 2, 3, 4, 5]
    assert got[0].reward == 0.1  # exact: rewards travel as float64
    assert [it.uid for it in resolve([last, head]).items] == ["u3", "u4", "u0", "u1"]


def test_a_chunk_holds_one_policy_version():
    with pytest.raises(ValueError, match=r"one policy version; got versions \[1, 2\]"):
        ExperienceChunk.inline([item("a", version=1), item("b", version=2)])
    assert ExperienceChunk.inline([]).count == 0


def test_items_whose_payload_died_with_its_owner_are_counted_lost(monkeypatch):
    """``resolve`` with remote payloads, fetched by ``fetch_objects``: one fetched, one whose owner
    (the maker) died."""
    import ray

    from ray_ppo.cluster.handles import fetch_objects

    alive, dead = object(), object()  # stand-ins for two ObjectRefs
    stored = {alive: ExperienceChunk.inline([item("a0"), item("a1")]).payload}

    def fake_get(refs):
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref is dead:
                raise ray.exceptions.OwnerDiedError("ff" * 28, None, "maker.send_loop")
        return [stored[r] for r in refs] if isinstance(refs, list) else stored[refs]

    monkeypatch.setattr(ray, "get", fake_get)
    dead_ids = np.array([7, 7, 8, 9, 9])  # the dead payload's items answer prompts 7, 7, 8, 9, 9
    chunks = [ExperienceChunk([dead], 3, 1, 5, dead_ids), ExperienceChunk([alive], 3, 0, 1),
              ExperienceChunk([alive], 3, 1, 2)]
    got, lost, lost_ids = resolve(chunks, fetch_objects)
    assert [it.uid for it in got] == ["a0", "a1"]
    assert lost == 4 and lost_ids == [7, 8, 9, 9]  # the prompts the rank reports, to be served again


def test_chunks_carry_their_items_prompt_ids_through_splits():
    items = [item(f"u{i}") for i in range(4)]
    for it, pid in zip(items, [10, 10, 11, 12]):
        it.prompt_id = pid
    chunk = ExperienceChunk.inline(items)
    head, rest = chunk.split(1)
    assert (head.item_prompt_ids(), rest.item_prompt_ids()) == ([10], [10, 11, 12])
    assert [it.prompt_id for it in resolve([rest]).items] == [10, 11, 12]  # and through packing
    assert ExperienceChunk([object()], 0, 0, 2).item_prompt_ids() == []  # made outside a stream


def test_inline_transport_carries_the_packed_items_in_the_chunk():
    chunk = ExperienceChunk.of([item("a"), item("b")], "inline")
    assert isinstance(chunk.payload, PackedItems) and (chunk.count, chunk.policy_version) == (2, 3)

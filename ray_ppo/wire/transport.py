"""How experience travels from a maker to a trainer rank: packed batches, inline or by ref.

A maker packs each batch it makes (``PackedItems``: a dozen flat arrays instead of 8 tensors per
item) and sends the coordinator an ``ExperienceChunk``: the payload, the item count and the
policy version. The coordinator buffers, slices and routes chunks by count and version only.
``topology.transport`` chooses the payload:

  - ``inline`` (default): the packed batch rides inside the calls, maker -> coordinator -> rank.
    Cheapest per batch on one node for small items (``benchmarks/coordinator_scale.py``), and the
    coordinator holds the only copy, so a maker that dies after sending loses nothing.
  - ``ref``: the maker ``ray.put``s the packed batch once and the chunk carries the ref (nested in
    a list, so Ray does not fetch it); the rank that pulls the chunk reads the object directly.
    The coordinator never carries the bytes: for large rollouts, or makers on other nodes than
    the coordinator. The maker owns the object (Ray 2.56 removed ``ray.put(_owner=...)``), so a
    batch sent by a maker that dies before a rank fetched it may be gone: ``resolve`` counts such
    items as lost, the rank reports them (``Coordinator.lost_in_transit``) and pulls replacements.

"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from ray_ppo.wire.packed import PackedItems

if TYPE_CHECKING:  # the coordinator routes chunks without importing torch
    from ray_ppo.algo import ExperienceItem


@dataclass(frozen=True)
class ExperienceChunk:
    """Items ``start:stop`` of one packed batch, all made at ``policy_version``, in whole groups of
    ``group_size`` consecutive items (the responses to one prompt: ``maker.samples_per_prompt``)."""

    payload: Any
    """``[ObjectRef]`` of a ``PackedItems`` (nested, so it is not fetched in transit), or a
    ``PackedItems`` inline."""
    policy_version: int
    start: int
    stop: int
    prompt_ids: Any = None
    """(N,) int64 NumPy array: the prompt id of each item of the payload (``ray_ppo.coordinator.ledger``),
    readable without fetching the payload; None for items made outside a prompt stream."""
    group_size: int = 1
    """Items per group; a chunk is only ever cut at a group boundary, so a group never splits."""
    lengths: Any = None
    """(N,) int64 NumPy array: the tokens of each item of the payload (prompt and response), readable
    without fetching the payload (the coordinator deals groups to ranks by them); None if unknown."""

    @property
    def count(self) -> int:
        return self.stop - self.start

    def item_prompt_ids(self) -> list[int]:
        """The prompt ids of items ``start:stop`` (empty if the payload carries none)."""
        return [] if self.prompt_ids is None else self.prompt_ids[self.start:self.stop].tolist()

    def tokens(self, start: int | None = None, stop: int | None = None) -> int:
        """The tokens of items ``start:stop`` of the payload (default: this chunk's ``start:stop``);
        0 if ``lengths`` is None."""
        if self.lengths is None:
            return 0
        return int(self.lengths[self.start if start is None else start:self.stop if stop is None else stop].sum())

    def group_tokens(self) -> list[int] | None:
        """The tokens of each whole group of items ``start:stop``, in order; None if ``lengths`` is."""
        if self.lengths is None:
            return None
        g = self.group_size
        return [int(self.lengths[i:i + g].sum()) for i in range(self.start, self.stop, g)]

    def split(self, n: int) -> tuple[ExperienceChunk, ExperienceChunk]:
        """The first ``n`` items and the rest, as two chunks of the same payload. ``n`` must be a
        multiple of ``group_size``: a cut never falls inside a group."""
        if n % self.group_size:
            raise ValueError(f"cannot cut a chunk after {n} items: groups of {self.group_size} would be split")
        cut = self.start + n
        return dataclasses.replace(self, stop=cut), dataclasses.replace(self, start=cut)

    @classmethod
    def of(cls, items: Sequence[ExperienceItem], transport: str, group_size: int = 1,
           put: Callable[[Any], Any] | None = None) -> ExperienceChunk:
        """``items`` packed for ``transport`` (``topology.transport``): ``inline``, or ``ref``: stored
        with ``put`` (``ray_ppo.cluster.handles.put_object``: the calling process owns the object)."""
        chunk = cls.stored(items, put) if transport == "ref" else cls.inline(items)
        if chunk.count % group_size:
            raise ValueError(f"{chunk.count} items do not make whole groups of {group_size}")
        return dataclasses.replace(chunk, group_size=group_size)

    @classmethod
    def inline(cls, items: Sequence[ExperienceItem]) -> ExperienceChunk:
        return cls(PackedItems.pack(items), _version(items), 0, len(items), _prompt_ids(items), lengths=_lengths(items))

    @classmethod
    def stored(cls, items: Sequence[ExperienceItem], put: Callable[[Any], Any] | None) -> ExperienceChunk:
        """``items`` packed and stored with ``put`` (value -> ref); the chunk carries the ref."""
        if put is None:
            raise ValueError("transport 'ref' needs put=, the object store's put (ray_ppo.cluster.handles.put_object)")
        return cls([put(PackedItems.pack(items))], _version(items), 0, len(items), _prompt_ids(items),
                   lengths=_lengths(items))


def _version(items: Sequence[ExperienceItem]) -> int:
    versions = {it.policy_version for it in items}
    if len(versions) > 1:
        raise ValueError(f"a chunk holds items of one policy version; got versions {sorted(versions)}")
    return versions.pop() if versions else 0


def _prompt_ids(items: Sequence[ExperienceItem]):
    import numpy as np

    return np.array([it.prompt_id for it in items], dtype=np.int64)


def _lengths(items: Sequence[ExperienceItem]):
    import numpy as np

    return np.array([it.prompt_ids.numel() + it.response_ids.numel() for it in items], dtype=np.int64)


class Fetched(NamedTuple):
    items: list[ExperienceItem]
    lost: int
    """Items whose payload died with the maker that owned it."""
    lost_prompt_ids: list[int] = []
    """The prompt ids of the lost items (their prompts are served again)."""


def resolve(chunks: Sequence[ExperienceChunk], fetch: Callable[[list], dict] | None = None) -> Fetched:
    """The items of ``chunks``, in order. Stored payloads are fetched in one call of ``fetch``
    (refs -> {ref: value, or None where it was lost}: ``ray_ppo.cluster.handles.fetch_objects``)."""
    from ray_ppo.algo.experience import unpack  # torch: here, on a trainer rank only
    refs = list(dict.fromkeys(c.payload[0] for c in chunks if isinstance(c.payload, list)))  # ObjectRefs hash by id
    if refs and fetch is None:
        raise ValueError("chunks stored by ref need fetch=, the object store's (ray_ppo.cluster.handles.fetch_objects)")
    fetched = fetch(refs) if refs else {}
    items: list[ExperienceItem] = []
    lost, lost_ids = 0, []
    for chunk in chunks:
        packed = fetched[chunk.payload[0]] if isinstance(chunk.payload, list) else chunk.payload
        if packed is None:
            lost += chunk.count
            lost_ids += chunk.item_prompt_ids()
        else:
            items += unpack(packed, chunk.start, chunk.stop)
    return Fetched(items, lost, lost_ids)

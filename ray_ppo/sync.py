"""Weight pushes: cut a state dict into buckets of bytes, and rebuild it on the other side.

A bucket is ``(metas, arrays)``: one flat ``uint8`` NumPy array per tensor, *viewing* the
tensor's memory (no copy here), and one ``TensorMeta`` per tensor saying what it is. ``ray.put``
of a bucket then makes the only copy, straight into the object store (NumPy arrays pickle as
out-of-band buffers), and every process on a node reads the arrays back zero-copy, so a bucket
is stored once however many makers read it. Dtypes travel as names and bytes verbatim: bf16
stays bf16 (NumPy has no bf16; the bytes do not care). Torch and NumPy only: no Ray import.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import torch


@dataclass(frozen=True)
class TensorMeta:
    """What one array of a bucket holds."""

    name: str
    dtype: str      # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int


Bucket = tuple[list[TensorMeta], list[np.ndarray]]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plan(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Group names into buckets of at most ``bucket_bytes`` (a bigger tensor gets a bucket alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and used + size > bucket_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return [g for g in groups if g]


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array: a view of a contiguous CPU tensor, else of a copy."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _pack(state: Mapping[str, torch.Tensor], names: list[str]) -> Bucket:
    metas = [TensorMeta(n, _dtype_name(state[n].dtype), tuple(state[n].shape), state[n].numel() * state[n].element_size())
             for n in names]
    return metas, [_bytes_view(state[n]) for n in names]


def join_state(actor: Mapping[str, torch.Tensor], critic: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One push/checkpoint state dict: keys prefixed ``actor.`` and ``critic.``."""
    return {**{f"actor.{k}": v for k, v in actor.items()}, **{f"critic.{k}": v for k, v in critic.items()}}


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inverse of ``join_state``: the actor's and the critic's tensors, prefixes removed."""
    actor = {k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")}
    critic = {k.removeprefix("critic."): v for k, v in state.items() if k.startswith("critic.")}
    return actor, critic


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that are second names of a tied tensor (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``): pushing them would send the same bytes twice."""
    canonical = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return set(model.state_dict()) - canonical


def push_aliases(actor: torch.nn.Module, critic: torch.nn.Module | None) -> set[str]:
    """The ``join_state`` names of both models' tied aliases: what a full push leaves out (no critic
    for the critic-free estimators)."""
    critic_aliases = tied_aliases(critic) if critic is not None else set()
    return set(join_state(dict.fromkeys(tied_aliases(actor)), dict.fromkeys(critic_aliases)))


def make_buckets(state: Mapping[str, torch.Tensor], bucket_mb: float) -> Iterable[Bucket]:
    """Yield the buckets of ``state`` one at a time (so a caller can ``ray.put`` and free each)."""
    for names in _plan(state, max(1, int(bucket_mb * 2**20))):
        yield _pack(state, names)


def unpack_bucket(bucket: Bucket) -> dict[str, torch.Tensor]:
    """Tensors viewing the bucket's arrays (no copy; read-only if the arrays are)."""
    metas, arrays = bucket
    out = {}
    with warnings.catch_warnings():  # Ray hands out read-only buffers; we never write to them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for meta, array in zip(metas, arrays):
            dtype = getattr(torch, meta.dtype)
            if meta.nbytes == 0:  # a 0-byte view cannot be reinterpreted; nothing to share anyway
                out[meta.name] = torch.empty(meta.shape, dtype=dtype)
                continue
            out[meta.name] = torch.from_numpy(array).view(dtype).reshape(meta.shape)
    return out


@dataclass
class StagedPush:
    """A weight push being received, from chunk_start to chunk_end: the tensors of the buckets
    that arrived (views of the pushed buffers, no copy) until all ``num_chunks`` are in."""

    version: int
    num_chunks: int
    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)

    def add(self, index: int, bucket: Bucket) -> None:
        self.tensors.update(unpack_bucket(bucket))
        self.seen.add(index)

    def complete(self, version: int) -> bool:
        """Every bucket of push ``version`` arrived."""
        return version == self.version and len(self.seen) == self.num_chunks


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(int(a.nbytes) for a in bucket[1])


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

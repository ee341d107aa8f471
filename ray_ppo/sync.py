"""Weight pushes: cut a state dict into byte buckets, and rebuild it on the other side.

A bucket is ``(metas, buffer)``: a flat ``uint8`` NumPy buffer holding the raw bytes of several
tensors, and one ``TensorMeta`` per tensor saying where it lies. NumPy buffers put with
``ray.put`` are read zero-copy by every process on a node, so a bucket is stored once however
many makers read it. Dtypes travel as names and bytes are copied verbatim: bf16 stays bf16
(NumPy has no bf16; the bytes do not care). Torch and NumPy only: no Ray import.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this offset, so its view is aligned for any dtype."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a bucket's buffer."""

    name: str
    dtype: str      # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int     # byte offset in the buffer
    nbytes: int


Bucket = tuple[list[TensorMeta], np.ndarray]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _plan(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Group names into buckets of at most ``bucket_bytes`` (a bigger tensor gets a bucket alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, tensor in state.items():
        size = _aligned(tensor.numel() * tensor.element_size())
        if groups[-1] and used + size > bucket_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return [g for g in groups if g]


def _pack(state: Mapping[str, torch.Tensor], names: list[str]) -> Bucket:
    metas, offset = [], 0
    for name in names:
        t = state[name]
        metas.append(TensorMeta(name, _dtype_name(t.dtype), tuple(t.shape), offset, t.numel() * t.element_size()))
        offset += _aligned(metas[-1].nbytes)
    buffer = np.empty(offset, dtype=np.uint8)
    for meta in metas:
        src = state[meta.name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        buffer[meta.offset:meta.offset + meta.nbytes] = src.numpy()
    return metas, buffer


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


def make_buckets(state: Mapping[str, torch.Tensor], bucket_mb: float) -> Iterable[Bucket]:
    """Yield the buckets of ``state`` one at a time (so a caller can ``ray.put`` and free each)."""
    for names in _plan(state, max(1, int(bucket_mb * 2**20))):
        yield _pack(state, names)


def unpack_bucket(bucket: Bucket) -> dict[str, torch.Tensor]:
    """Tensors viewing the bucket's buffer (no copy; read-only if the buffer is)."""
    metas, buffer = bucket
    out = {}
    with warnings.catch_warnings():  # Ray hands out read-only buffers; we never write to them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for meta in metas:
            dtype = getattr(torch, meta.dtype)
            if meta.nbytes == 0:  # a 0-byte view cannot be reinterpreted; nothing to share anyway
                out[meta.name] = torch.empty(meta.shape, dtype=dtype)
                continue
            raw = torch.from_numpy(buffer[meta.offset:meta.offset + meta.nbytes])
            out[meta.name] = raw.view(dtype).reshape(meta.shape)
    return out


def bucket_nbytes(bucket: Bucket) -> int:
    return int(bucket[1].nbytes)


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

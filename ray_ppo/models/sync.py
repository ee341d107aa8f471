"""Weight pushes: cut a state dict into buckets of bytes, and rebuild it on the other side.

A bucket is ``(metas, arrays)``: one flat ``uint8`` NumPy array per tensor, *viewing* the
tensor's memory (no copy here), and one ``TensorMeta`` per tensor saying what it is. ``ray.put``
of a bucket then makes the only copy, straight into the object store (NumPy arrays pickle as
out-of-band buffers), and every process on a node reads the arrays back zero-copy, so a bucket
is stored once however many makers read it. Dtypes travel as names and bytes verbatim: bf16
stays bf16 (NumPy has no bf16; the bytes do not care). Torch and NumPy only: no Ray import.

A push is pipelined: rank 0 hands each bucket on as soon as it is put, and a maker stages
bucket k (``StagedPush.add``) while rank 0 puts bucket k+1. A CPU maker with ``sync.zero_copy``
keeps the tensors where the object store holds them (no copy at all: the makers of a node share
one copy of the weights); otherwise it copies them into tensors of its own, on its device and in
its dtype, while it generates. The swap is prepared while it generates too (``prepare_swap``:
shapes checked, conversions, each tensor's owner found), and ``PreparedSwap.apply`` then only
rebinds the model's parameters to the staged tensors, so a maker pauses for pointer swaps, not a copy.
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
    """One push/checkpoint state dict: keys prefixed ``actor.`` and ``critic.``.

    Args:
        actor: the actor's state dict (name -> tensor).
        critic: the critic's state dict (name -> tensor; empty without a critic).

    Returns:
        The joined dict; the tensors are the same objects.
    """
    return {**{f"actor.{k}": v for k, v in actor.items()}, **{f"critic.{k}": v for k, v in critic.items()}}


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inverse of ``join_state``: the actor's and the critic's tensors, prefixes removed.

    Args:
        state: a joined state dict (``join_state``).

    Returns:
        Tuple ``(actor, critic)`` of state dicts; keys with neither prefix are dropped.
    """
    actor = {k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")}
    critic = {k.removeprefix("critic."): v for k, v in state.items() if k.startswith("critic.")}
    return actor, critic


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that are second names of a tied tensor (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``): pushing them would send the same bytes twice.

    Args:
        model: the model.

    Returns:
        The alias names.
    """
    canonical = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return set(model.state_dict()) - canonical


def push_aliases(actor: torch.nn.Module, critic: torch.nn.Module | None) -> set[str]:
    """The ``join_state`` names of both models' tied aliases: what a full push leaves out (no critic
    for the critic-free estimators).

    Args:
        actor: the actor.
        critic: the critic, or None.

    Returns:
        The prefixed alias names (``actor.<name>``, ``critic.<name>``).
    """
    critic_aliases = tied_aliases(critic) if critic is not None else set()
    return set(join_state(dict.fromkeys(tied_aliases(actor)), dict.fromkeys(critic_aliases)))


def push_size(state: Mapping[str, torch.Tensor], bucket_mb: float) -> tuple[int, int]:
    """(number of buckets, bytes) that ``make_buckets`` will yield, without packing anything.

    Args:
        state: the state dict to push (name -> tensor).
        bucket_mb: the bucket size in MiB.

    Returns:
        Tuple ``(num_buckets, nbytes)``.
    """
    plan = _plan(state, max(1, int(bucket_mb * 2**20)))
    return len(plan), sum(state[n].numel() * state[n].element_size() for names in plan for n in names)


def make_buckets(state: Mapping[str, torch.Tensor], bucket_mb: float) -> Iterable[Bucket]:
    """Yield the buckets of ``state`` one at a time (so a caller can ``ray.put`` and free each).

    Args:
        state: the state dict to push (name -> tensor, any dtype and device).
        bucket_mb: the bucket size in MiB (a bigger tensor gets a bucket alone).

    Yields:
        ``(metas, arrays)`` buckets: one ``TensorMeta`` and one flat uint8 array per tensor, in ``state``'s order.
    """
    for names in _plan(state, max(1, int(bucket_mb * 2**20))):
        yield _pack(state, names)


def unpack_bucket(bucket: Bucket) -> dict[str, torch.Tensor]:
    """Tensors viewing the bucket's arrays (no copy; read-only if the arrays are).

    Args:
        bucket: ``(metas, arrays)`` as ``make_buckets`` yields it.

    Returns:
        Name -> CPU tensor with the dtype and shape of its ``TensorMeta``.
    """
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
    that arrived until all ``num_chunks`` are in.

    With ``targets`` (the receiving model's state dict), each tensor is copied as it arrives into
    a fresh tensor with its target's dtype and device, ready to be swapped in by ``assign_state``
    without a second copy; the models are not touched, so dropping a StagedPush leaves the
    previous weights. A tensor without a matching target (unknown name, other shape) stays a
    view of the pushed buffer, for the receiver's key and shape checks to refuse. ``spares``
    (name -> tensor no longer used by any model, e.g. the previous push's swapped-out weights) are
    copied into instead of fresh tensors when they match: no new memory to allocate and fault in.

    With ``share`` (``sync.zero_copy`` on a CPU maker), a tensor whose target has its dtype and
    device is not copied at all: the view of the pushed buffer is staged as it is (its name goes
    into ``shared``), so after the swap the model's weight *is* the object store's buffer, read
    by every maker of the node from one copy. Such a weight must never be written to (the buffer
    is shared; Ray hands it out read-only), so it never becomes a spare.
    """

    version: int
    num_chunks: int
    targets: Mapping[str, torch.Tensor] | None = None
    spares: dict[str, torch.Tensor] = field(default_factory=dict)
    share: bool = False
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: set[str] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)

    def add(self, index: int, bucket: Bucket) -> None:
        """Stage the tensors of bucket ``index`` of the push.

        Args:
            index: the bucket's index in the push, 0 to ``num_chunks`` - 1.
            bucket: ``(metas, arrays)`` as ``make_buckets`` yields it.
        """
        self.stage(unpack_bucket(bucket))
        self.seen.add(index)

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold ``tensors`` for the swap: copies shaped like their targets (if any), or with
        ``share`` the pushed views themselves where the target's dtype and device match.

        Args:
            tensors: name -> pushed tensor.
        """
        targets = self.targets or {}
        for name, tensor in tensors.items():
            like = targets.get(name)
            if like is not None and like.shape == tensor.shape:
                if self.share and (tensor.dtype, tensor.device) == (like.dtype, like.device):
                    self.shared.add(name)  # the pushed buffer itself becomes the weight: no copy
                else:
                    spare = self.spares.pop(name, None)
                    fits = spare is not None and (spare.shape, spare.dtype, spare.device) == (like.shape, like.dtype, like.device)
                    tensor = (spare if fits else torch.empty_like(like)).copy_(tensor)
            self.tensors[name] = tensor

    def complete(self, version: int) -> bool:
        """Every bucket of push ``version`` arrived.

        Args:
            version: the push's policy version.

        Returns:
            True if this is push ``version`` and all ``num_chunks`` buckets were added.
        """
        return version == self.version and len(self.seen) == self.num_chunks


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names sharing one parameter, canonical name first (the one ``named_parameters`` keeps):
    e.g. ``[["transformer.wte.weight", "lm_head.weight"]]`` for GPT-2.

    Args:
        model: the model.

    Returns:
        One list of names per tied parameter (untied ones are left out).
    """
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


@dataclass
class PreparedSwap:
    """``assign_state`` made ready: each name's owner module, attribute and new tensor (a
    ``Parameter`` where the model holds one, tied aliases bound to their canonical's). ``apply``
    only rebinds attributes, so a caller that pauses the model's users for a swap can prepare it
    first, while they run (``prepare_swap``)."""

    binds: list[tuple[torch.nn.Module, str, torch.Tensor]]
    load: tuple[torch.nn.Module, dict[str, torch.Tensor], list[list[str]]] | None = None
    """For a model with its own state-dict loading (a ``_load_from_state_dict`` override or a
    load hook): ``load_state_dict(assign=True)`` and re-tying, in ``apply``, instead of ``binds``."""

    def apply(self) -> None:
        """Rebind the model's parameters and buffers to the prepared tensors."""
        if self.load is not None:
            model, state, groups = self.load
            model.load_state_dict(state, strict=False, assign=True)
            _retie(model, groups)
        for owner, attr, tensor in self.binds:
            setattr(owner, attr, tensor)


def prepare_swap(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> PreparedSwap:
    """Prepare swapping ``state``'s tensors in as the model's parameters and buffers (no copy;
    tied parameters stay tied to their canonical tensor). Tensors whose dtype or device differ
    from the model's are converted here, so the model keeps its own dtype and device.

    Keys are not checked here (unknown names are ignored): callers check them before swapping.
    Shapes are, for every name before anything is bound, so a bad push leaves the model whole.
    Raises ValueError naming the first tensor whose shape differs from the model's.

    Args:
        model: the model to receive the tensors.
        state: name -> tensor, names as in ``model.state_dict()``.

    Returns:
        The ``PreparedSwap``; nothing changes in ``model`` until its ``apply``.

    Raises:
        ValueError: if a tensor's shape differs from the model's tensor of that name.
    """
    current = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        if name in current and tensor.shape != current[name].shape:
            raise ValueError(f"pushed {name} has shape {tuple(tensor.shape)}, the model's is "
                             f"{tuple(current[name].shape)}: the push is not of this model")
    own = {k: v.to(dtype=current[k].dtype, device=current[k].device) for k, v in state.items() if k in current}
    groups = tied_groups(model)
    if _loads_its_own_way(model):
        return PreparedSwap(binds=[], load=(model, own, groups))
    new: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        old = current[name]
        is_param = isinstance(old, torch.nn.Parameter)
        new[name] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad) if is_param else tensor
    for canonical, *aliases in groups:  # an alias is bound to its canonical's tensor, pushed or not
        for alias in aliases:
            new[alias] = new.get(canonical, current[canonical])
    binds = []
    for name, tensor in new.items():
        owner, _, attr = name.rpartition(".")
        binds.append((model.get_submodule(owner), attr, tensor))
    return PreparedSwap(binds)


def assign_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Swap ``state``'s tensors in as the model's parameters and buffers at once: ``prepare_swap``
    then ``apply``.

    Args:
        model: the model to receive the tensors.
        state: name -> tensor, names as in ``model.state_dict()``.

    Raises:
        ValueError: if a tensor's shape differs from the model's tensor of that name (nothing is swapped).
    """
    prepare_swap(model, state).apply()


def _loads_its_own_way(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` changes how a state dict loads (then rebinding attributes
    would skip what it does)."""
    base = torch.nn.Module._load_from_state_dict
    return any(type(m)._load_from_state_dict is not base or m._load_state_dict_pre_hooks
               or m._load_state_dict_post_hooks for m in model.modules())


def _retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    for canonical, *aliases in groups:
        param = model.get_parameter(canonical)
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def replaced_tensors(before: dict[str, torch.Tensor], pushed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a swap of ``pushed`` took out of the models: no model uses them any more. Tied
    names (one tensor under two names) are left out, so no buffer is handed out twice.

    Args:
        before: name -> tensor, the models' state before the swap.
        pushed: name -> tensor, what the swap put in.

    Returns:
        Name -> the tensor of ``before`` that ``pushed`` replaced (empty tensors left out).
    """
    counts: dict[int, int] = {}
    for tensor in before.values():
        counts[tensor.data_ptr()] = counts.get(tensor.data_ptr(), 0) + 1
    return {name: before[name] for name in pushed
            if name in before and before[name].numel() and counts[before[name].data_ptr()] == 1}


def bucket_nbytes(bucket: Bucket) -> int:
    """The bytes of a bucket's arrays.

    Args:
        bucket: ``(metas, arrays)`` as ``make_buckets`` yields it.

    Returns:
        The total number of bytes.
    """
    return sum(int(a.nbytes) for a in bucket[1])


def cast_floating(state: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (a name: "bfloat16"), as a receiver of
    that dtype holds them after a push (``copy_`` rounds as ``to`` does); the others as they are.

    Args:
        state: name -> tensor.
        dtype: a torch dtype name without the "torch." prefix.

    Returns:
        Name -> tensor, same shapes and devices.
    """
    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}


def as_held(state: Mapping[str, torch.Tensor], actor_dtype: str, critic_dtype: str) -> dict[str, torch.Tensor]:
    """A joined push state (``join_state``) as a maker holds it: the actor's floating tensors in
    ``actor_dtype`` (its engine's), the critic's in ``critic_dtype``.

    Args:
        state: a joined state dict (``join_state``).
        actor_dtype: the dtype name of the maker's actor.
        critic_dtype: the dtype name of the maker's critic.

    Returns:
        The joined state dict, cast.
    """
    actor, critic = split_state(state)
    return join_state(cast_floating(actor, actor_dtype), cast_floating(critic, critic_dtype))


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff the weights are bit-identical.

    Args:
        state: name -> tensor (any device).

    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

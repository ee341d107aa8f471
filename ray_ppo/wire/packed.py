"""Experience items laid out flat for the wire (``PackedItems``), in NumPy.

This module imports neither torch nor the rest of ``ray_ppo.algo``: the coordinator, which
only buffers and routes packed batches, unpickles them without paying for a torch import in its
process (seconds of CPU at every ``fit()`` on a small machine). Packing reads the items' tensors
through their own methods; ``ray_ppo.algo.experience.unpack`` rebuilds the items where
they are trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PER_TOKEN_FIELDS = ("action_log_probs", "ref_log_probs", "values", "rewards", "advantages", "returns")
"""The float32 fields with one entry per response token, shared by items and batches."""

INT_FIELDS = ("prompt_ids", "response_ids")


@dataclass
class PackedItems:
    """Items laid out flat for the wire: every field of every item concatenated into one array,
    with offsets. N items pickle as ~12 arrays instead of 8N tensors (a Ray send of 32 packed
    items costs about a tenth of 32 separate ones: ``benchmarks/coordinator_scale.py``).

    ``arrays[f][offsets[i]:offsets[i + 1]]`` is field ``f`` of item ``i``, where ``offsets`` is
    ``prompt_offsets`` for ``prompt_ids`` and ``response_offsets`` for the response-length fields.
    """

    arrays: dict
    """Field name -> flat NumPy array (int64 token ids, float32 per-token fields)."""
    prompt_offsets: object
    """(N+1,) int64 NumPy array."""
    response_offsets: object
    """(N+1,) int64 NumPy array."""
    reward: object
    """(N,) float64 NumPy array (an item's reward is a Python float)."""
    policy_version: object
    """(N,) int64 NumPy array."""
    uids: list[str]
    prompts: list
    """The prompt of each item as the data gave it (``ExperienceItem.prompt``): a text, a list of
    chat messages, or None."""
    prompt_id: object = None
    """(N,) int64 NumPy array; None means -1 for every item."""
    action_mask: object = None
    """Flat bool NumPy array over every response token (``response_offsets``), the items' action
    masks (True where an item has none); None when no item has one."""
    has_mask: object = None
    """(N,) bool NumPy array: which items have an action mask; None with ``action_mask``."""
    episodes: list | None = None
    """Each item's episode counts (``ExperienceItem.episode``); None when no item has them."""
    truncated: object = None
    """(N,) bool NumPy array, ``ExperienceItem.truncated``; None when no item is truncated."""
    version_runs: list | None = None
    """Each item's ``ExperienceItem.version_runs``; None when no item has them."""

    def __len__(self) -> int:
        return len(self.uids)

    @classmethod
    def pack(cls, items: Sequence) -> PackedItems:
        """``ExperienceItem``s, flat (``ray_ppo.algo.experience.unpack`` rebuilds them)."""
        import torch  # here, not at the top: the coordinator unpickles packed batches without torch

        def flat(name: str, dtype) -> np.ndarray:  # one torch.cat, then NumPy: few per-item torch calls
            if not items:
                return np.empty(0, dtype)
            joined = torch.cat([getattr(it, name).reshape(-1) for it in items]).detach().cpu()
            return joined.numpy().astype(dtype, copy=False)

        def offsets(name: str) -> np.ndarray:
            return np.cumsum([0] + [getattr(it, name).numel() for it in items], dtype=np.int64)

        has_mask = np.array([it.action_mask is not None for it in items], dtype=bool)
        action_mask = None
        if has_mask.any():
            action_mask = np.concatenate([it.action_mask.detach().cpu().numpy().astype(bool) if it.action_mask is not None
                                          else np.ones(it.response_ids.numel(), dtype=bool) for it in items])
        episodes = [it.episode for it in items]
        truncated = np.array([it.truncated for it in items], dtype=bool)
        runs = [it.version_runs for it in items]
        arrays = {name: flat(name, np.int64) for name in INT_FIELDS}
        arrays.update({name: flat(name, np.float32) for name in PER_TOKEN_FIELDS})
        return cls(arrays=arrays, prompt_offsets=offsets("prompt_ids"), response_offsets=offsets("response_ids"),
                   reward=np.array([it.reward for it in items], dtype=np.float64),
                   policy_version=np.array([it.policy_version for it in items], dtype=np.int64),
                   uids=[it.uid for it in items], prompts=[it.prompt for it in items],
                   prompt_id=np.array([it.prompt_id for it in items], dtype=np.int64),
                   action_mask=action_mask, has_mask=has_mask if action_mask is not None else None,
                   episodes=episodes if any(e is not None for e in episodes) else None,
                   truncated=truncated if truncated.any() else None,
                   version_runs=runs if any(r is not None for r in runs) else None)

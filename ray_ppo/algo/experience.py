"""Typed PPO experience: one unpadded sample (`ExperienceItem`) and a padded batch (`ExperienceBatch`).

Makers produce items; the buffer stores items; the trainer merges items into batches. Items carry
no padding, so samples of any prompt and response lengths can be mixed freely: `merge` pads them
and `split` strips that padding exactly (`split(merge(items)) == items`).

The response of a multi-turn episode (``ray_ppo.makers.episodes``) holds the policy's tokens and the
environment's between its turns: every one is in the context (``attention_mask``), only the
policy's are actions (``action_mask``: trained, KL-penalised, valued; the per-token fields are 0
on the others).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ray_ppo.wire.packed import PER_TOKEN_FIELDS, PackedItems


def _tensors(obj) -> dict[str, torch.Tensor]:
    """The tensor-valued fields of a dataclass instance, by name."""
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


@dataclass
class ExperienceItem:
    """One sample, unpadded. Shapes: P_i = prompt length, R_i = response length (>= 1)."""

    prompt_ids: torch.Tensor
    """(P_i,) int64, no padding."""
    response_ids: torch.Tensor
    """(R_i,) int64, generated tokens incl. the EOS token if one was generated; no padding."""
    action_log_probs: torch.Tensor
    """(R_i,) float32, log-probs of the response tokens under the behaviour policy that generated them."""
    ref_log_probs: torch.Tensor
    """(R_i,) float32, log-probs of the response tokens under the reference model."""
    values: torch.Tensor
    """(R_i,) float32, critic values."""
    rewards: torch.Tensor
    """(R_i,) float32, KL-penalised per-token rewards."""
    advantages: torch.Tensor
    """(R_i,) float32."""
    returns: torch.Tensor
    """(R_i,) float32."""
    reward: float
    """Scalar score of the response (reward model or rule)."""
    policy_version: int
    """Version of the policy weights that generated the response."""
    uid: str = ""
    """Unique id ("<maker>-<counter>-<index>"), for accounting."""
    prompt_id: int = -1
    """Identity of the prompt the item answers (``ray_ppo.coordinator.ledger``; several items may share one);
    -1 outside a prompt stream."""
    prompt: str | list[dict] | None = None
    """The prompt the item answers as the data gave it (``ray_ppo.data.Prompt``: a text
    or a list of chat messages); None for an item made from token ids alone."""
    action_mask: torch.Tensor | None = None
    """(R_i,) bool, True on the response tokens the policy generated, False on an environment's
    (a multi-turn episode); None: every response token is the policy's."""
    episode: dict | None = None
    """A multi-turn episode's counts (``ray_ppo.makers.episodes.Episode.info``: turns, fault, the
    environment's own); None for a single completion."""
    truncated: bool = False
    """The response was cut at ``maker.max_new_tokens`` without an end token (a single completion
    only: False for a multi-turn episode)."""
    version_runs: tuple[tuple[int, int], ...] | None = None
    """The policy versions that sampled the response's tokens, as runs ``((version, tokens), ...)``
    in token order: a streaming maker swaps weights in while a sequence runs
    (``maker.weight_updates=in_flight``), so its tokens may span versions, the oldest being
    ``policy_version``. None: every token was sampled at ``policy_version``."""

    @classmethod
    def filled(cls, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
               per_token: Callable[[str], torch.Tensor] | None = None, **fields) -> ExperienceItem:
        """An item whose per-token fields (``PER_TOKEN_FIELDS``) are ``per_token(name)``, zeros by
        default: for tests and benchmarks that need items without a model. ``fields`` gives the
        others (``reward``, ``policy_version``, ``uid``, ``prompt_id``, ``prompt``, ``truncated``).

        Args:
            prompt_ids: (P_i,) int64 tensor of prompt token ids.
            response_ids: (R_i,) int64 tensor of response token ids.
            per_token: maps a per-token field's name to its (R_i,) float32 tensor; None for zeros.
            **fields: the item's other fields, by name.

        Returns:
            The item.
        """
        make = per_token or (lambda name: torch.zeros(response_ids.numel()))
        return cls(prompt_ids=prompt_ids, response_ids=response_ids, **{name: make(name) for name in PER_TOKEN_FIELDS},
                   **fields)

    @property
    def response_length(self) -> int:
        """R_i, the number of response tokens."""
        return int(self.response_ids.numel())

    @property
    def num_actions(self) -> int:
        """The number of response tokens the policy generated (R_i unless an environment's are among them)."""
        return self.response_length if self.action_mask is None else int(self.action_mask.sum())


def _check_item(i: int, item: ExperienceItem) -> None:
    """Raise ValueError naming the problem if `item` cannot be padded into a batch."""
    if item.response_length == 0:
        raise ValueError(f"item {i} (uid={item.uid!r}) has a zero-length response; R_i must be >= 1")
    for name in PER_TOKEN_FIELDS:
        if getattr(item, name).shape != item.response_ids.shape:
            raise ValueError(
                f"item {i} (uid={item.uid!r}): {name} has shape {tuple(getattr(item, name).shape)}, "
                f"expected {tuple(item.response_ids.shape)} like response_ids"
            )
    if item.action_mask is not None and (item.action_mask.shape != item.response_ids.shape
                                         or not bool(item.action_mask.any())):
        raise ValueError(f"item {i} (uid={item.uid!r}): action_mask must have the shape of response_ids "
                         f"{tuple(item.response_ids.shape)} and mark at least one token the policy generated")


@dataclass
class ExperienceBatch:
    """B samples padded to a rectangle. P = max prompt length, R = max response length.

    Prompts are LEFT-padded to P and responses RIGHT-padded to R, so every response starts at column P.
    """

    sequences: torch.Tensor
    """(B, P+R) int64, prompt then response tokens."""
    attention_mask: torch.Tensor
    """(B, P+R) int64, 1 on real prompt and response tokens."""
    action_mask: torch.Tensor
    """(B, R) bool, True on the response tokens the policy generated: what is trained. An
    environment's tokens in a multi-turn episode are False here and 1 in ``attention_mask``."""
    action_log_probs: torch.Tensor
    """(B, R) float32, 0 outside ``action_mask`` (as are all per-token fields below)."""
    ref_log_probs: torch.Tensor
    """(B, R) float32."""
    values: torch.Tensor
    """(B, R) float32."""
    rewards: torch.Tensor
    """(B, R) float32."""
    advantages: torch.Tensor
    """(B, R) float32."""
    returns: torch.Tensor
    """(B, R) float32."""
    reward: torch.Tensor
    """(B,) float32, scalar score of each response."""
    policy_version: torch.Tensor
    """(B,) int64, policy version that generated each response."""
    uids: list[str]
    """B unique ids."""
    prompt_len: int
    """P, the column where every response starts."""
    pad_token_id: int
    """Token id written at padded positions of `sequences`."""
    truncated: torch.Tensor | None = None
    """(B,) bool, the responses cut at ``maker.max_new_tokens`` without an end token
    (``ExperienceItem.truncated``); None: none is."""

    @property
    def num_actions(self) -> int:
        """R, the padded response length."""
        return self.action_mask.shape[1]

    @property
    def batch_size(self) -> int:
        """B, the number of samples."""
        return self.sequences.shape[0]

    def position_ids(self) -> torch.Tensor:
        """(B, P+R) int64 positions that count real tokens only, so left padding does not shift them.

        Returns:
            (B, P+R) int64 tensor, 0 on the left padding and at each row's first real token.
        """
        return (self.attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)

    def to(self, device: torch.device | str) -> ExperienceBatch:
        """A copy with every tensor on `device`.

        Args:
            device: the target device.

        Returns:
            The batch on ``device`` (same shapes and dtypes).
        """
        return dataclasses.replace(self, **{k: v.to(device) for k, v in _tensors(self).items()})

    def select(self, indices: Sequence[int] | torch.Tensor) -> ExperienceBatch:
        """The rows `indices` (e.g. a minibatch), keeping P and R.

        Args:
            indices: M row indices, a sequence of ints or an (M,) int tensor.

        Returns:
            A batch of M rows, in the order of ``indices``: (M, P+R) sequences, (M, R) per-token fields.
        """
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.sequences.device)
        tensors = {k: v.index_select(0, idx) for k, v in _tensors(self).items()}
        return dataclasses.replace(self, **tensors, uids=[self.uids[i] for i in idx.tolist()])

    def split(self) -> list[ExperienceItem]:
        """The B unpadded items: inverse of `merge`. Each field is masked once for the whole batch
        and cut into rows (row-major order), so the items view one tensor per field. A response is
        every attended token after the prompt; an item's ``action_mask`` is kept only where it
        leaves some of them out.

        Returns:
            B items, in row order; each item's tensors view the batch's (on its device).
        """
        P, B = self.prompt_len, self.batch_size
        prompt_mask, response_mask = self.attention_mask[:, :P].bool(), self.attention_mask[:, P:].bool()
        prompt_lens, response_lens = prompt_mask.sum(dim=1).tolist(), response_mask.sum(dim=1).tolist()
        prompts = self.sequences[:, :P][prompt_mask].split(prompt_lens)
        per_token = {"response_ids": self.sequences[:, P:][response_mask].split(response_lens)}
        per_token.update((name, getattr(self, name)[response_mask].split(response_lens)) for name in PER_TOKEN_FIELDS)
        actions = self.action_mask.bool()
        holes = (actions != response_mask).any(dim=1).tolist()
        masks = actions[response_mask].split(response_lens) if any(holes) else [None] * B
        rewards, versions = self.reward.tolist(), self.policy_version.tolist()
        truncated = self.truncated.tolist() if self.truncated is not None else [False] * B
        return [ExperienceItem(prompt_ids=prompts[i], **{name: rows[i] for name, rows in per_token.items()},
                               reward=rewards[i], policy_version=versions[i], uid=self.uids[i],
                               action_mask=masks[i] if holes[i] else None, truncated=truncated[i]) for i in range(B)]

    @classmethod
    def merge(cls, items: Sequence[ExperienceItem], pad_token_id: int) -> ExperienceBatch:
        """Pad `items` into one batch: prompts left-padded to P, responses right-padded to R. Each
        field is written with one masked assignment of the items' concatenated values.

        Args:
            items: the B items, each with (P_i,) prompt and (R_i,) response tensors, on one device.
            pad_token_id: the token id written at padded positions of ``sequences``.

        Returns:
            The batch: (B, P+R) int64 sequences and attention mask, (B, R) bool action mask and
            (B, R) float32 per-token fields, on the items' device.

        Raises:
            ValueError: if ``items`` is empty, or an item has a zero-length response, a per-token
                field or action mask not shaped like its response, or an action mask with no token set.
        """
        if len(items) == 0:
            raise ValueError("cannot merge an empty list of ExperienceItem")
        for i, item in enumerate(items):
            _check_item(i, item)
        B, device = len(items), items[0].response_ids.device
        prompt_lens = torch.tensor([item.prompt_ids.numel() for item in items], device=device)
        response_lens = torch.tensor([item.response_length for item in items], device=device)
        P, R = int(prompt_lens.max()), int(response_lens.max())
        prompt_mask = torch.arange(P, device=device) >= P - prompt_lens.unsqueeze(1)  # left padding
        response_mask = torch.arange(R, device=device) < response_lens.unsqueeze(1)  # right padding
        action_mask = response_mask.clone()
        if any(item.action_mask is not None for item in items):
            action_mask[response_mask] = torch.cat([item.action_mask.bool() if item.action_mask is not None
                                                    else torch.ones(item.response_length, dtype=torch.bool,
                                                                    device=device) for item in items])
        sequences = torch.full((B, P + R), pad_token_id, dtype=torch.long, device=device)
        sequences[:, :P][prompt_mask] = torch.cat([item.prompt_ids for item in items]).long()
        sequences[:, P:][response_mask] = torch.cat([item.response_ids for item in items]).long()
        per_token = {}
        for name in PER_TOKEN_FIELDS:
            per_token[name] = torch.zeros(B, R, dtype=torch.float32, device=device)
            per_token[name][response_mask] = torch.cat([getattr(item, name) for item in items]).float()
        return cls(
            sequences=sequences,
            attention_mask=torch.cat([prompt_mask, response_mask], dim=1).long(),
            action_mask=action_mask,
            **per_token,
            reward=torch.tensor([item.reward for item in items], dtype=torch.float32, device=device),
            policy_version=torch.tensor([item.policy_version for item in items], dtype=torch.long, device=device),
            uids=[item.uid for item in items],
            prompt_len=P,
            pad_token_id=pad_token_id,
            truncated=torch.tensor([item.truncated for item in items], dtype=torch.bool, device=device),
        )


def unpack(packed: PackedItems, start: int = 0, stop: int | None = None) -> list[ExperienceItem]:
    """Items ``start:stop`` of ``packed``. Their tensors view one writable copy of each field's
    range (Ray hands out read-only buffers), so unpacking costs one copy per field, not one per item.

    Args:
        packed: the packed items (``PackedItems``).
        start: the first item.
        stop: one past the last item; None for the end.

    Returns:
        ``stop - start`` items on the CPU, with (P_i,) prompt and (R_i,) per-token tensors.
    """
    stop = len(packed) if stop is None else stop
    p_base, r_base = int(packed.prompt_offsets[start]), int(packed.response_offsets[start])
    p_end, r_end = int(packed.prompt_offsets[stop]), int(packed.response_offsets[stop])
    fields = {name: torch.from_numpy(a[p_base:p_end].copy() if name == "prompt_ids" else a[r_base:r_end].copy())
              for name, a in packed.arrays.items()}
    masks = None if packed.action_mask is None else torch.from_numpy(packed.action_mask[r_base:r_end].copy())
    out = []
    for i in range(start, stop):
        p0, p1 = int(packed.prompt_offsets[i]) - p_base, int(packed.prompt_offsets[i + 1]) - p_base
        r0, r1 = int(packed.response_offsets[i]) - r_base, int(packed.response_offsets[i + 1]) - r_base
        out.append(ExperienceItem(prompt_ids=fields["prompt_ids"][p0:p1],
                                  **{name: fields[name][r0:r1] for name in ("response_ids", *PER_TOKEN_FIELDS)},
                                  reward=float(packed.reward[i]), policy_version=int(packed.policy_version[i]),
                                  uid=packed.uids[i], prompt=packed.prompts[i],
                                  prompt_id=-1 if packed.prompt_id is None else int(packed.prompt_id[i]),
                                  action_mask=masks[r0:r1] if masks is not None and packed.has_mask[i] else None,
                                  episode=None if packed.episodes is None else packed.episodes[i],
                                  truncated=packed.truncated is not None and bool(packed.truncated[i]),
                                  version_runs=None if packed.version_runs is None else packed.version_runs[i]))
    return out

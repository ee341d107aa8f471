"""Sampling responses from a causal LM: left-padded prompts in, a padded rollout out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ray_ppo.config import SamplingParams  # the maker section's sampling settings; cfg.maker is one


@dataclass
class Rollout:
    """Generated sequences. P = prompt width (left-padded), R = response width (right-padded).

    sequences: (B, P+R) int64; attention_mask: (B, P+R); action_mask: (B, R) bool, True on
    response tokens up to and including the first EOS. All on the device of the model that sampled.
    log_probs: (B, R) float32, the sampler's own log-probs of the response tokens, when it reports
    them (a vLLM engine); None for HF ``generate``.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    log_probs: torch.Tensor | None = None

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into (input_ids, attention_mask), each (B, P)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def response_mask(responses: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """True on tokens up to and including the first EOS of each row (B, R)."""
    if eos_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    is_eos = (responses == eos_token_id).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos  # EOS tokens strictly before t
    return eos_before == 0


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (a quantized model keeps its embeddings as parameters)."""
    return next(model.parameters()).device


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
             pad_token_id: int, eos_token_id: int | None) -> Rollout:
    """Sample one response per prompt with ``model.generate``; the rollout is on ``model``'s device."""
    device = model_device(model)
    input_ids, prompt_mask = left_pad(prompts, pad_token_id)
    input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
    out = model.generate(
        input_ids=input_ids, attention_mask=prompt_mask, do_sample=True,
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
    )
    prompt_len = input_ids.shape[1]
    action_mask = response_mask(out[:, prompt_len:], eos_token_id)
    attention_mask = torch.cat([prompt_mask, action_mask.long()], dim=1)
    sequences = out.masked_fill(attention_mask == 0, pad_token_id)
    return Rollout(sequences, attention_mask, action_mask, prompt_len)

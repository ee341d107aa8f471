"""DAPO's overlong reward shaping: a response that nears the length limit loses reward.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476, section 3.4. With L_max the limit (``maker.max_new_tokens``) and L_cache the
buffer before it (``algo.overlong_buffer``), eq. 13's soft overlong punishment is

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max

scaled here by ``algo.overlong_penalty`` (DAPO: 1) and added to the response's score. Responses
never exceed L_max (generation stops there), so the penalty runs linearly from 0 where the buffer
starts to -overlong_penalty at the limit. The other half of DAPO's overlong handling, masking
truncated responses out of the loss (overlong filtering), is ``algo.overlong_filter`` in the learner.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """(B,) response lengths in tokens -> (B,) float32 penalties, each in [-penalty, 0] (DAPO eq. 13).

    Args:
        lengths: (B,) int or float tensor, the number of tokens of each response.
        max_new_tokens: L_max, the response length limit.
        buffer: L_cache, the tokens before the limit where the penalty grows.
        penalty: the penalty at the limit (``algo.overlong_penalty``).

    Returns:
        (B,) float32 tensor of penalties to add to the scores.

    Raises:
        ValueError: if ``buffer`` is not in (0, max_new_tokens).
    """
    if not 0 < buffer < max_new_tokens:
        raise ValueError(f"the overlong buffer must be in (0, max_new_tokens={max_new_tokens}), got {buffer}")
    expected = max_new_tokens - buffer
    exceed = (lengths.float() - expected).clamp(min=0.0, max=float(buffer))
    return -penalty * exceed / buffer

"""Per-step statistics of the experience a rank trained on (torch only, no Ray: the local loop
uses them too)."""

from __future__ import annotations

import torch

from ray_ppo.core.algo import ExperienceItem


def experience_metrics(items: list[ExperienceItem], version: int) -> dict[str, float]:
    """Reward, KL, length and staleness statistics of the items of one step."""
    rewards = torch.tensor([it.reward for it in items])
    lengths = torch.tensor([it.response_length for it in items], dtype=torch.float32)
    kl = torch.cat([it.action_log_probs - it.ref_log_probs for it in items])
    staleness = torch.tensor([version - it.policy_version for it in items], dtype=torch.float32)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(items) > 1 else 0.0,
            "kl": float(kl.mean()), "response_length": float(lengths.mean()),
            "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}

"""Per-step statistics of the experience a rank trained on (torch only, no Ray: the local loop
uses them too)."""

from __future__ import annotations

import torch

from ray_ppo.algo import ExperienceItem


def experience_metrics(items: list[ExperienceItem], version: int, reference: bool = True) -> dict[str, float]:
    """Reward, KL (with a ``reference``: ``ppo.uses_reference``), length and staleness statistics of
    the items of one step, and of multi-turn episodes the ``env/...`` means of their counts
    (``ExperienceItem.episode``) and ``fault_count``, how many an environment fault ended.

    Args:
        items: the step's items (unpadded; per-token fields (R_i,) float32).
        version: the trainer's policy version, against which staleness is counted.
        reference: whether the run has a reference model (then ``kl`` is reported).

    Returns:
        Dict from metric names to floats.
    """
    rewards = torch.tensor([it.reward for it in items])
    lengths = torch.tensor([it.num_actions for it in items], dtype=torch.float32)
    kl = torch.cat([_actions(it.action_log_probs - it.ref_log_probs, it) for it in items])
    staleness = torch.tensor([version - it.policy_version for it in items], dtype=torch.float32)
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(items) > 1 else 0.0,
               **({"kl": float(kl.mean())} if reference else {}), "response_length": float(lengths.mean()),
               "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}
    episodes = [it.episode for it in items if it.episode is not None]
    for key in sorted({key for counts in episodes for key, value in counts.items() if not isinstance(value, str)}):
        metrics[f"env/{key}"] = sum(counts.get(key, 0.0) for counts in episodes) / len(episodes)
    if episodes:
        metrics["fault_count"] = float(sum(counts["fault"] for counts in episodes))
    return metrics


def _actions(values: torch.Tensor, item: ExperienceItem) -> torch.Tensor:
    """``values`` (one per response token) at the tokens the policy generated."""
    return values if item.action_mask is None else values[item.action_mask.bool()]

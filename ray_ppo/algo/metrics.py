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
               "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
               **token_lag(items, version)}
    episodes = [it.episode for it in items if it.episode is not None]
    for key in sorted({key for counts in episodes for key, value in counts.items() if not isinstance(value, str)}):
        metrics[f"env/{key}"] = sum(counts.get(key, 0.0) for counts in episodes) / len(episodes)
    if episodes:
        metrics["fault_count"] = float(sum(counts["fault"] for counts in episodes))
    return metrics


def token_lag(items: list[ExperienceItem], version: int) -> dict[str, float]:
    """The policy lag of the tokens trained: ``version`` minus the version that sampled each response
    token (``ExperienceItem.version_runs``; ``policy_version`` for every token of an item without
    them), its mean over the tokens and its max, and the mean number of weight swaps a response
    spans (its version runs less one; 0 unless a streaming maker swapped weights in mid-sequence).

    Args:
        items: the step's items.
        version: the trainer's policy version.

    Returns:
        ``token_lag_mean``, ``token_lag_max`` and ``swaps_per_sequence``.
    """
    tokens = lag_sum = swaps = 0
    lag_max = float("-inf")
    for it in items:
        runs = it.version_runs or ((it.policy_version, it.response_length),)
        for v, n in runs:
            tokens, lag_sum, lag_max = tokens + n, lag_sum + n * (version - v), max(lag_max, version - v)
        swaps += len(runs) - 1
    return {"token_lag_mean": lag_sum / max(tokens, 1), "token_lag_max": float(lag_max),
            "swaps_per_sequence": swaps / len(items)}


def _actions(values: torch.Tensor, item: ExperienceItem) -> torch.Tensor:
    """``values`` (one per response token) at the tokens the policy generated."""
    return values if item.action_mask is None else values[item.action_mask.bool()]

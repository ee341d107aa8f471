"""Critic-free advantage estimators: GRPO (and Dr. GRPO), RLOO and REINFORCE++.

Shapes: B = batch size (n * number of prompts for the group estimators), T = response length.
A *group* is the ``n`` responses sampled for one prompt; they sit next to each other in the
batch (rows ``g * n`` to ``g * n + n - 1``), as the makers lay them out and the coordinator keeps
them (a group is never split across ranks or buffers).

Outcome estimators (GRPO, RLOO) turn one scalar score per response into one advantage per
response, which every token of the response then shares (``broadcast_to_tokens``).
"""

from __future__ import annotations

import torch

from ray_ppo.algo.functional import compute_gae, kl_penalized_rewards, left_aligned, masked_whiten
from ray_ppo.config.choices import ADVANTAGES as ADVANTAGE_ESTIMATORS


def needs_critic(estimator: str) -> bool:
    """True if ``estimator`` needs a value model (only GAE does).

    Args:
        estimator: an advantage estimator's name (``algo.advantage``).

    Returns:
        Whether the estimator needs a critic.

    Raises:
        ValueError: if ``estimator`` is not a known estimator.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return estimator == "gae"


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores -> (B / n, n), one row per group; raises if B is not a multiple of n."""
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores cannot be cut into groups of {group_size}; "
                         f"the batch must hold whole groups (a multiple of maker.samples_per_prompt)")
    return scores.reshape(-1, group_size)


def grpo_advantages(scores: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """(B,) scores -> (B,) group-normalised advantages (r - mean_group) / (std_group + eps).

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2 (outcome supervision);
    std is the unbiased one, as veRL's ``compute_grpo_outcome_advantage``. With
    ``norm_by_std=False`` the advantage is r - mean_group: Liu et al. 2025, "Understanding
    R1-Zero-Like Training" (Dr. GRPO), arXiv:2503.20783, which drops the std because it
    up-weights prompts that are too easy or too hard. A group of one has no baseline: its
    advantage is the score itself (mean 0, std 1, as veRL). A group of equal scores gets 0
    (0 / (0 + eps)), never nan.

    Args:
        scores: (B,) float tensor, one score per response, groups contiguous.
        group_size: n, the number of responses per prompt.
        norm_by_std: divide by the group's standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        (B,) float32 tensor of advantages.

    Raises:
        ValueError: if B is not a multiple of ``group_size`` (or ``group_size`` < 1).
    """
    groups = _groups(scores.float(), group_size)
    if group_size == 1:
        return groups.reshape(-1).clone()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores -> (B,) leave-one-out advantages r_i - mean_{j != i} r_j within each group.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs", arXiv:2402.14740, eq. 7 (Kool et al. 2019). Equal to
    n / (n - 1) * (r_i - mean_group). A group of one has no other sample: its baseline is 0 and
    its advantage the score itself (as veRL's ``compute_rloo_outcome_advantage``).

    Args:
        scores: (B,) float tensor, one score per response, groups contiguous.
        group_size: n, the number of responses per prompt.

    Returns:
        (B,) float32 tensor of advantages.

    Raises:
        ValueError: if B is not a multiple of ``group_size`` (or ``group_size`` < 1).
    """
    groups = _groups(scores.float(), group_size)
    if group_size == 1:
        return groups.reshape(-1).clone()
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).reshape(-1)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-response advantages -> (B, T): every valid token gets its response's value, padding 0.

    Args:
        advantages: (B,) float tensor, one advantage per response.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.

    Returns:
        (B, T) float32 tensor.
    """
    return torch.where(mask.bool(), advantages.unsqueeze(1).to(torch.float32), 0.0)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) per-token rewards -> (B, T) returns G_t = r_t + gamma * G_{t+1}, 0 outside ``mask``.

    The time steps of a row are its valid tokens in order (``left_aligned``: an environment's
    tokens between turns are skipped), so the return of the last valid token is its reward.

    Args:
        rewards: (B, T) float tensor, the per-token rewards.
        mask: (B, T) bool or 0/1 tensor of the valid tokens (the time steps).
        gamma: discount factor.

    Returns:
        (B, T) float tensor of returns (``rewards``' dtype).
    """
    order, valid = left_aligned(mask)
    rewards = torch.where(valid, rewards.gather(1, order), 0.0)
    running = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, 0.0)
        out.append(running)
    return torch.zeros_like(rewards).scatter(1, order, torch.stack(out[::-1], dim=1))


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) KL-penalised per-token rewards -> (B, T) REINFORCE++ advantages.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262, eq. 5-6: the discounted return of the token-level rewards (score at the last
    token, -kl_coef * KL_t on every token), normalised over the whole batch (global batch
    normalisation, no critic and no per-prompt baseline). In the pipeline the batch is the trainer's
    training batch: makers send the returns, the learner normalises them (``masked_whiten``).
    A batch of equal returns gets 0, never nan.

    Args:
        rewards: (B, T) float tensor, the KL-penalised per-token rewards.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.
        gamma: discount factor.

    Returns:
        (B, T) float tensor of advantages, 0 outside ``mask``.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def compute_advantages(estimator: str, score: torch.Tensor, kl: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, *, kl_coef: float, kl_in: str = "reward", gamma: float = 1.0,
                       lam: float = 0.95, group_size: int = 1,
                       group_norm_std: bool = True,
                       token_scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, advantages, returns), each (B, T) and 0 at padding, for one batch of responses.

    ``score`` (B,) is the scalar reward of each response, ``kl`` (B, T) the per-token KL estimate
    against the reference, ``values`` (B, T) the critic's values (zeros without a critic). With
    ``kl_in="reward"`` the KL is a per-token penalty in the rewards (Ziegler et al. 2019); with
    ``"loss"`` the rewards hold the score alone and the learner adds the KL to the loss.
    ``token_scores`` (B, T): where each part of the score sits (a multi-turn episode's reward of
    each turn at that turn's last token; ``score`` is then their sum); None: all at the last token.

    - ``gae``: GAE over the per-token rewards (``compute_gae``); returns are the critic's targets;
    - ``grpo`` / ``rloo``: the response's total reward (score minus the summed KL penalty, as
      OpenRLHF's RLOO) against its group's, broadcast to every token;
    - ``reinforce_pp``: the discounted returns of the per-token rewards; the learner normalises
      them over its training batch (``reinforce_pp_advantages``), so advantages == returns here.

    Args:
        estimator: the advantage estimator: "gae", "grpo", "rloo" or "reinforce_pp".
        score: (B,) float tensor, the scalar reward of each response.
        kl: (B, T) float tensor, the per-token KL estimate against the reference.
        values: (B, T) float tensor, the critic's values (zeros without a critic).
        mask: (B, T) bool or 0/1 tensor of the policy's tokens.
        kl_coef: the KL coefficient beta.
        kl_in: "reward" (KL penalty in the rewards) or "loss" (the learner adds it to the loss).
        gamma: discount factor (gae, reinforce_pp).
        lam: GAE lambda (gae).
        group_size: n, the responses per prompt (grpo, rloo).
        group_norm_std: divide GRPO's advantages by the group's standard deviation.
        token_scores: (B, T) float tensor placing the score per token, or None for the last token.

    Returns:
        Tuple ``(rewards, advantages, returns)``, each a (B, T) float tensor, 0 at padding.

    Raises:
        ValueError: if ``estimator`` is unknown, or B is not whole groups of ``group_size`` (grpo, rloo).
    """
    rewards = kl_penalized_rewards(score, kl, mask, kl_coef if kl_in == "reward" else 0.0, token_scores)
    if estimator == "gae":
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        return rewards, advantages, returns
    if estimator == "reinforce_pp":
        returns = discounted_returns(rewards, mask, gamma)
        return rewards, returns, returns
    total = torch.where(mask.bool(), rewards, 0.0).sum(dim=1)
    if estimator == "grpo":
        per_response = grpo_advantages(total, group_size, group_norm_std)
    elif estimator == "rloo":
        per_response = rloo_advantages(total, group_size)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS)}")
    advantages = broadcast_to_tokens(per_response, mask)
    return rewards, advantages, advantages

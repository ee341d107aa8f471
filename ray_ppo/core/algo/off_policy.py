"""Off-policy correction for training on stale experience: truncated IS and the decoupled PPO weights.

Three policies meet in a detached PPO step (per token, log-probs of the sampled token):

  - behaviour ``mu``: the maker's policy that generated the item (``action_log_probs``, possibly
    several versions old, or a quantized copy);
  - proximal / old ``pi_old``: the trainer's policy at the start of the step, recomputed by the
    trainer (one no-grad forward pass);
  - current ``pi``: the policy being updated.

Both corrections clip the PPO ratio pi / pi_old around the trainer's own policy and multiply each
token's loss by an importance weight w = pi_old / mu (detached); they differ in what happens to a
weight above the cap:

  - ``tis`` truncates it to the cap (truncated importance sampling: Ionides 2008; as veRL's and
    OpenRLHF's TIS, threshold 2, Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training");
  - ``decoupled`` drops the token (weight 0): the decoupled PPO objective of Hilton et al. 2022,
    "Batch Size-Invariance for Policy Optimization", arXiv:2110.00641, eq. 2, with the proximal
    policy recomputed by the trainer and the behaviour weight capped as AReaL does (Fu et al. 2025,
    arXiv:2505.24298, section 5.2; AReaL's ``behav_imp_weight_cap``, 5).
"""

from __future__ import annotations

import torch

from ray_ppo.choices import OFF_POLICY as OFF_POLICY_MODES  # noqa: F401  (re-exported by ray_ppo.core.algo)
from ray_ppo.core.algo.functional import masked_mean


def _check_cap(cap: float) -> None:
    if not cap >= 1.0:
        raise ValueError(f"an importance-weight cap must be >= 1, got {cap}")


def raw_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token pi_old / mu, detached, before any cap."""
    return torch.exp((old_log_probs - behaviour_log_probs).detach())


def tis_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated IS weights min(pi_old / mu, cap) per token, detached."""
    _check_cap(cap)
    return torch.clamp(raw_weights(old_log_probs, behaviour_log_probs), max=cap)


def decoupled_weights(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """Decoupled PPO behaviour weights pi_prox / mu where <= cap, else 0, detached.

    As AReaL's ``ppo_actor_loss_fn``: a token whose weight exceeds the cap is masked out of the
    loss (its weight is 0) rather than truncated.
    """
    _check_cap(cap)
    raw = raw_weights(proximal_log_probs, behaviour_log_probs)
    return torch.where(raw > cap, 0.0, raw)


def importance_weights(mode: str, old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                       cap: float) -> torch.Tensor:
    """The weights of ``ppo.off_policy`` mode ``tis`` or ``decoupled`` (see the module docstring)."""
    if mode == "tis":
        return tis_weights(old_log_probs, behaviour_log_probs, cap)
    if mode == "decoupled":
        return decoupled_weights(old_log_probs, behaviour_log_probs, cap)
    raise ValueError(f"ppo.off_policy={mode!r} has no importance weights; use tis or decoupled")


def behaviour_kl(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi_prox) from tokens sampled from mu, non-negative.

    With log r = log pi_prox - log mu: k3 = (r - 1) - log r (http://joschu.net/blog/kl-approx.html).
    """
    log_ratio = (proximal_log_probs - behaviour_log_probs).detach()
    return torch.exp(log_ratio) - 1 - log_ratio


def kl_by_staleness(kl: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                    max_staleness: int) -> dict[int, float]:
    """Mean per-token ``kl`` (B, T) over the rows of each staleness 0..max_staleness (B,);
    nan for a staleness that no row has."""
    out = {}
    for s in range(max_staleness + 1):
        rows = staleness == s
        out[s] = float(masked_mean(kl[rows], mask[rows])) if bool(rows.any()) else float("nan")
    return out


def weight_stats(raw: torch.Tensor, cap: float, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max of the raw weights pi_old / mu over the valid tokens (before the cap), and the
    share of tokens whose weight exceeded ``cap`` (truncated by ``tis``, dropped by ``decoupled``)."""
    valid = mask.bool()
    return {"is_weight_mean": float(masked_mean(raw, valid)),
            "is_weight_max": float(raw[valid].max()) if bool(valid.any()) else float("nan"),
            "is_capped_frac": float(masked_mean((raw > cap).float(), valid))}

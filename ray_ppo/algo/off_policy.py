"""Off-policy correction for training on stale experience: importance weights per token or per sequence.

Three policies meet in a detached PPO step (per token, log-probs of the sampled token):

  - behaviour ``mu``: the maker's policy that generated the item (``action_log_probs``, possibly
    several versions old, or a quantized copy);
  - proximal / old ``pi_old``: the trainer's policy at the start of the step, recomputed by the
    trainer (one no-grad forward pass);
  - current ``pi``: the policy being updated.

Every correction clips the PPO ratio pi / pi_old around the trainer's own policy and multiplies
each token's loss by an importance weight built from w_t = pi_old / mu (detached). They differ in
what the weight is and what happens to an outlier (a weight of 0 masks a token out of the loss's
numerator; it still counts in ``ppo.loss_agg``'s denominators, as in each paper's estimator):

  - ``tis`` truncates each token's weight to the cap (truncated importance sampling: Ionides 2008;
    as veRL's and OpenRLHF's TIS, threshold 2, Yao et al. 2025 "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training");
  - ``decoupled`` drops a token above the cap (weight 0): the decoupled PPO objective of Hilton
    et al. 2022, "Batch Size-Invariance for Policy Optimization", arXiv:2110.00641, eq. 2, with the
    proximal policy recomputed by the trainer and the behaviour weight capped as AReaL does (Fu et
    al. 2025, arXiv:2505.24298, section 5.2; AReaL's ``behav_imp_weight_cap``, 5);
  - ``seq_tis`` weights every token of a sequence by the sequence's likelihood ratio
    prod_t w_t, truncated to the cap (sequence-level TIS: Liu, Li et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; veRL's
    ``rollout_is=sequence``);
  - ``seq_mask`` keeps the token weights of ``tis`` but masks a whole sequence whose geometric-mean
    weight exp(mean_t log w_t) leaves a band around 1 (seq-mask-TIS, the same authors' geometric
    rejection; veRL's ``rollout_rs=geometric``);
  - ``icepop`` keeps a token's raw weight inside a band [low, high] and masks it outside (IcePop:
    Ling Team 2025, "Every Step Evolves" (Ring-1T), arXiv:2510.18855: M(k) = k on [alpha, beta],
    else 0, with alpha 0.5 and beta 5).

Sequence weights are over each sequence's valid tokens (``mask``): the environment's tokens
between the turns of a multi-turn episode are no part of them.

Shapes: B = number of sequences, T = response length in tokens. Every ``mask`` is (B, T), bool or
0/1, set on the policy's tokens; log-probs are float tensors of the sampled tokens.
"""

from __future__ import annotations

import math

import torch

from ray_ppo.algo.functional import masked_mean, masked_sum
from ray_ppo.config.choices import OFF_POLICY as OFF_POLICY_MODES  # noqa: F401  (re-exported by ray_ppo.algo)


def _check_cap(cap: float) -> None:
    if not cap >= 1.0:
        raise ValueError(f"an importance-weight cap must be >= 1, got {cap}")


def _check_band(band: tuple[float, float]) -> None:
    low, high = band
    if not 0.0 < low < 1.0 < high:
        raise ValueError(f"an importance-weight band [low, high] must have 0 < low < 1 < high, got [{low}, {high}]")


def raw_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token pi_old / mu, detached, before any cap.

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.

    Returns:
        (B, T) float tensor of weights.
    """
    return torch.exp((old_log_probs - behaviour_log_probs).detach())


def tis_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated IS weights min(pi_old / mu, cap) per token, detached.

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        cap: the truncation threshold, >= 1.

    Returns:
        (B, T) float tensor of weights in [0, cap].

    Raises:
        ValueError: if ``cap`` < 1.
    """
    _check_cap(cap)
    return torch.clamp(raw_weights(old_log_probs, behaviour_log_probs), max=cap)


def decoupled_weights(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """Decoupled PPO behaviour weights pi_prox / mu where <= cap, else 0, detached.

    As AReaL's ``ppo_actor_loss_fn``: a token whose weight exceeds the cap is masked out of the
    loss (its weight is 0) rather than truncated.

    Args:
        proximal_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_prox.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        cap: the drop threshold, >= 1.

    Returns:
        (B, T) float tensor of weights in [0, cap].

    Raises:
        ValueError: if ``cap`` < 1.
    """
    _check_cap(cap)
    raw = raw_weights(proximal_log_probs, behaviour_log_probs)
    return torch.where(raw > cap, 0.0, raw)


def seq_tis_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                    cap: float) -> torch.Tensor:
    """Sequence-level truncated IS: min(prod_t pi_old / mu, cap) over each sequence's valid tokens,
    on every one of them (0 elsewhere), detached. The product is taken in log space.

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        mask: (B, T) bool or 0/1 tensor of each sequence's valid tokens.
        cap: the truncation threshold, >= 1.

    Returns:
        (B, T) float tensor: each row's sequence weight on its valid tokens, 0 elsewhere.

    Raises:
        ValueError: if ``cap`` < 1.
    """
    _check_cap(cap)
    log_w = masked_sum((old_log_probs - behaviour_log_probs).detach(), mask, dim=1)
    w = torch.exp(torch.clamp(log_w, max=math.log(cap)))
    return torch.where(mask.bool(), w.unsqueeze(1), 0.0)


def geometric_mean_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """(B,) per sequence the geometric mean of its valid tokens' weights, exp(mean_t log(pi_old / mu)),
    detached: the length-normalised sequence weight (1 for a sequence without a valid token).

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        mask: (B, T) bool or 0/1 tensor of each sequence's valid tokens.

    Returns:
        (B,) float tensor, one weight per sequence.
    """
    valid = mask.bool()
    log_w = masked_sum((old_log_probs - behaviour_log_probs).detach(), valid, dim=1)
    return torch.exp(log_w / valid.sum(dim=1).clamp(min=1))


def _in_band(w: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    return (w >= band[0]) & (w <= band[1])


def seq_mask_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                     cap: float, band: tuple[float, float]) -> torch.Tensor:
    """seq-mask-TIS: the token weights min(pi_old / mu, cap), and 0 on every token of a sequence whose
    geometric-mean weight (``geometric_mean_weights``) is outside ``band`` = (low, high) (and off
    ``mask``), detached.

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        mask: (B, T) bool or 0/1 tensor of each sequence's valid tokens.
        cap: the per-token truncation threshold, >= 1.
        band: (low, high) with 0 < low < 1 < high, the geometric-mean weights a sequence may have.

    Returns:
        (B, T) float tensor of weights.

    Raises:
        ValueError: if ``band`` is not 0 < low < 1 < high, or ``cap`` < 1.
    """
    _check_band(band)
    keep = _in_band(geometric_mean_weights(old_log_probs, behaviour_log_probs, mask), band).unsqueeze(1)
    return torch.where(keep & mask.bool(), tis_weights(old_log_probs, behaviour_log_probs, cap), 0.0)


def icepop_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                   band: tuple[float, float]) -> torch.Tensor:
    """IcePop's masked weights: pi_old / mu where it lies in ``band`` = (low, high), else 0, detached.

    Args:
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        band: (low, high) with 0 < low < 1 < high, the weights kept.

    Returns:
        (B, T) float tensor of weights.

    Raises:
        ValueError: if ``band`` is not 0 < low < 1 < high.
    """
    _check_band(band)
    raw = raw_weights(old_log_probs, behaviour_log_probs)
    return torch.where(_in_band(raw, band), raw, 0.0)


def importance_weights(mode: str, old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                       mask: torch.Tensor, cap: float, band: tuple[float, float] | None = None) -> torch.Tensor:
    """The (B, T) weights of ``ppo.off_policy`` mode ``mode`` (see the module docstring): ``cap`` is
    the truncation or drop threshold (tis, decoupled, seq_tis, seq_mask), ``band`` the (low, high)
    band of seq_mask and icepop.

    Args:
        mode: "tis", "decoupled", "seq_tis", "seq_mask" or "icepop".
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        mask: (B, T) bool or 0/1 tensor of each sequence's valid tokens (seq_tis, seq_mask).
        cap: the truncation or drop threshold, >= 1.
        band: (low, high) with 0 < low < 1 < high (seq_mask, icepop); None for the other modes.

    Returns:
        (B, T) float tensor of detached weights.

    Raises:
        ValueError: if ``mode`` has no weights (``none`` or unknown), or ``cap`` or ``band`` is out of range.
    """
    if mode == "tis":
        return tis_weights(old_log_probs, behaviour_log_probs, cap)
    if mode == "decoupled":
        return decoupled_weights(old_log_probs, behaviour_log_probs, cap)
    if mode == "seq_tis":
        return seq_tis_weights(old_log_probs, behaviour_log_probs, mask, cap)
    if mode == "seq_mask":
        return seq_mask_weights(old_log_probs, behaviour_log_probs, mask, cap, band)
    if mode == "icepop":
        return icepop_weights(old_log_probs, behaviour_log_probs, band)
    raise ValueError(f"ppo.off_policy={mode!r} has no importance weights; use one of "
                     f"{', '.join(m for m in OFF_POLICY_MODES if m != 'none')}")


def behaviour_kl(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi_prox) from tokens sampled from mu, non-negative.

    With log r = log pi_prox - log mu: k3 = (r - 1) - log r (http://joschu.net/blog/kl-approx.html).

    Args:
        proximal_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_prox.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.

    Returns:
        (B, T) float tensor, detached.
    """
    log_ratio = (proximal_log_probs - behaviour_log_probs).detach()
    return torch.exp(log_ratio) - 1 - log_ratio


def kl_by_staleness(kl: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                    max_staleness: int) -> dict[int, float]:
    """Mean per-token ``kl`` (B, T) over the rows of each staleness 0..max_staleness (B,);
    nan for a staleness that no row has.

    Args:
        kl: (B, T) float tensor, a per-token KL estimate.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.
        staleness: (B,) int tensor, each row's trainer version minus the version that made it.
        max_staleness: the largest staleness reported.

    Returns:
        Dict from each staleness 0..max_staleness to the mean KL of its rows' valid tokens.
    """
    out = {}
    for s in range(max_staleness + 1):
        rows = staleness == s
        out[s] = float(masked_mean(kl[rows], mask[rows])) if bool(rows.any()) else float("nan")
    return out


def weight_stats(raw: torch.Tensor, cap: float, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max of the raw weights pi_old / mu over the valid tokens (before the cap), and the
    share of tokens whose weight exceeded ``cap`` (truncated by ``tis``, dropped by ``decoupled``).

    Args:
        raw: (B, T) float tensor of raw weights (``raw_weights``).
        cap: the threshold counted in ``is_capped_frac``.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.

    Returns:
        Dict with float ``is_weight_mean``, ``is_weight_max`` (nan without a valid token) and ``is_capped_frac``.
    """
    valid = mask.bool()
    return {"is_weight_mean": float(masked_mean(raw, valid)),
            "is_weight_max": float(raw[valid].max()) if bool(valid.any()) else float("nan"),
            "is_capped_frac": float(masked_mean((raw > cap).float(), valid))}


def correction_stats(mode: str, old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                     cap: float, band: tuple[float, float] | None = None) -> dict[str, float]:
    """What the correction ``mode`` saw and did on a batch: ``is_weight_mean`` and ``is_weight_max``
    (``weight_stats``) for every mode, and the share of what it truncated or masked:
    ``is_capped_frac`` (tokens above ``cap``: tis, decoupled, seq_mask), ``seq_capped_frac``
    (seq_tis: sequences whose weight exceeded ``cap``), ``seq_masked_frac`` (seq_mask: sequences
    outside ``band``) and ``icepop_masked_frac`` (icepop: tokens outside ``band``).

    Args:
        mode: the ``ppo.off_policy`` mode: "tis", "decoupled", "seq_tis", "seq_mask" or "icepop".
        old_log_probs: (B, T) float tensor, log-probs of the sampled tokens under pi_old.
        behaviour_log_probs: (B, T) float tensor, log-probs of the same tokens under mu.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.
        cap: the truncation or drop threshold.
        band: (low, high), the band of seq_mask and icepop; None for the other modes.

    Returns:
        Dict from the statistics' names to floats.
    """
    valid = mask.bool()
    raw = raw_weights(old_log_probs, behaviour_log_probs)
    stats = weight_stats(raw, cap, valid)
    if mode not in ("tis", "decoupled", "seq_mask"):
        del stats["is_capped_frac"]
    sequences = valid.any(dim=1)
    if mode == "seq_tis":
        log_w = masked_sum((old_log_probs - behaviour_log_probs).detach(), valid, dim=1)
        stats["seq_capped_frac"] = float(masked_mean((log_w > math.log(cap)).float(), sequences))
    if mode == "seq_mask":
        outside = ~_in_band(geometric_mean_weights(old_log_probs, behaviour_log_probs, valid), band)
        stats["seq_masked_frac"] = float(masked_mean(outside.float(), sequences))
    if mode == "icepop":
        stats["icepop_masked_frac"] = float(masked_mean((~_in_band(raw, band)).float(), valid))
    return stats

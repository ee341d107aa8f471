"""PPO losses, advantages and KL estimates for language models, as pure functions of tensors.

Shapes: B = batch size, T = response length (tokens), V = vocabulary size. Every `mask` may be
bool or 0/1 and marks the valid tokens: the policy's own, not padding and not an environment's
tokens between the turns of a multi-turn episode (a mask may have holes). Masked-out entries of
the inputs do not change any result (keep them finite where gradients flow: a nan poisons the
backward pass).
"""

from __future__ import annotations

import torch

from ray_ppo.config.choices import KL_ESTIMATORS as KL_ESTIMATOR_NAMES
from ray_ppo.config.choices import LOSS_AGGS as LOSS_AGGREGATIONS
from ray_ppo.config.choices import POLICY_LOSSES  # noqa: F401  (re-exported by ray_ppo.algo)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over the positions where `mask` is set (over `dim`, or over everything).

    Args:
        x: float tensor of any shape, e.g. (B, T).
        mask: bool or 0/1 tensor of the shape of ``x``, set on the positions that count.
        dim: the dimension to sum over; None sums over every position.

    Returns:
        Tensor of ``x``'s dtype: 0-dim with ``dim=None``, else ``x``'s shape without ``dim``
        ((B,) for a (B, T) ``x`` and ``dim=1``).
    """
    x = torch.where(mask.bool(), x, 0.0)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is set; nan where no position is set.

    Args:
        x: float tensor of any shape, e.g. (B, T).
        mask: bool or 0/1 tensor of the shape of ``x``, set on the positions that count.
        dim: the dimension to average over; None averages over every position.

    Returns:
        Float tensor: 0-dim with ``dim=None``, else ``x``'s shape without ``dim``.
    """
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is set (Bessel-corrected if `unbiased`).

    Args:
        x: float tensor of any shape, e.g. (B, T).
        mask: bool or 0/1 tensor of the shape of ``x``, set on the positions that count.
        unbiased: divide by n - 1 instead of n (n = the number of set positions).

    Returns:
        0-dim float tensor.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = masked_sum(torch.ones_like(x), mask)
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise `x` to zero mean and unit variance over the valid positions; 0 where `mask` is unset.

    As `whiten` in OpenAI lm-human-preferences (lm_human_preferences/utils/core.py), which uses the
    population variance; with `shift_mean=False` the mean is added back (only the scale changes).

    Args:
        x: (B, T) float tensor, e.g. advantages.
        mask: (B, T) bool or 0/1 tensor of the valid positions.
        shift_mean: subtract the mean (else only divide by the standard deviation).
        eps: added to the variance before its inverse square root.

    Returns:
        (B, T) float tensor, 0 where ``mask`` is unset.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=False)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def left_aligned(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, prefix): gathering a (B, T) tensor by ``order`` moves each row's valid positions to
    its front, in order, and ``prefix`` is the mask of the gathered rows (a valid prefix of each row).
    ``out.scatter(1, order, x)`` puts a gathered ``x`` back. Time-step recursions (GAE, discounted
    returns) run on the gathered rows, so positions outside ``mask`` (an environment's tokens in a
    multi-turn episode, ``ray_ppo.makers.episodes``) are skipped, not counted as time steps.

    Args:
        mask: (B, T) bool or 0/1 tensor of the valid positions.

    Returns:
        Tuple ``(order, prefix)``: ``order`` (B, T) int64 column indices for ``gather(1, order)``,
        ``prefix`` (B, T) bool, True on the first ``mask.sum(1)`` columns of each row.
    """
    valid = mask.bool()
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return order, valid.gather(1, order)


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token generalised advantage estimation, vectorised over the batch.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", arXiv:1506.02438, eq. 16:
        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t),   A_t = delta_t + gamma * lam * A_{t+1}
    Inputs are (B, T); the time steps of a row are its valid tokens (`mask`), in order, so the
    step after the last token of one turn of a multi-turn episode is the first token of the next
    (the environment's tokens between them are no actions). The episode ends at the last valid
    token, so V and A beyond it are 0. Returns (advantages, returns), both (B, T) and 0 outside
    `mask`, with returns = advantages + values (the critic's regression target).

    Args:
        rewards: (B, T) float tensor, the per-token rewards r_t.
        values: (B, T) float tensor, the critic's values V(s_t).
        mask: (B, T) bool or 0/1 tensor of the valid tokens (the time steps).
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        Tuple ``(advantages, returns)``, each a (B, T) float tensor, 0 outside ``mask``.
    """
    order, valid = left_aligned(mask)
    rewards = torch.where(valid, rewards.gather(1, order), 0.0)
    values = torch.where(valid, values.gather(1, order), 0.0)
    T = rewards.shape[1]
    lastgaelam = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else torch.zeros_like(lastgaelam)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = torch.where(valid[:, t], delta + gamma * lam * lastgaelam, 0.0)
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    back = torch.zeros_like(advantages)
    return back.scatter(1, order, advantages), back.scatter(1, order, advantages + values)


def compute_gae_reference(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_gae` as a plain loop over samples and their valid time steps: the readable reference for tests.

    Schulman et al. 2016, arXiv:1506.02438, eq. 16; same inputs and outputs as `compute_gae`.

    Args:
        rewards: (B, T) float tensor, the per-token rewards r_t.
        values: (B, T) float tensor, the critic's values V(s_t).
        mask: (B, T) bool or 0/1 tensor of the valid tokens (the time steps).
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        Tuple ``(advantages, returns)``, each a (B, T) float tensor, 0 outside ``mask``.
    """
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(rewards.shape[0]):
        steps = mask[b].bool().nonzero().flatten().tolist()
        lastgaelam = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = values[b, steps[i + 1]] if i + 1 < len(steps) else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages[b, t] = lastgaelam
            returns[b, t] = lastgaelam + values[b, t]
    return advantages, returns


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token_mean") -> torch.Tensor:
    """Reduce a (B, T) per-token loss over the valid tokens.

    - ``token_mean``: mean over every valid token of the batch (long responses weigh more; PPO's
      usual choice, DAPO's "token-level" loss, Yu et al. 2025, arXiv:2503.14476, eq. 12);
    - ``seq_mean_token_sum``: sum over each response's tokens, mean over responses (the
      length-unnormalised loss of Dr. GRPO, Liu et al. 2025, arXiv:2503.20783);
    - ``seq_mean_token_mean``: mean over each response's tokens, then over responses (GRPO as in
      Shao et al. 2024, arXiv:2402.03300, eq. 3).
    A row without a valid token (a response filtered out of the loss) is no response of the means;
    with no valid token at all the loss is 0 (and its gradient too). Names as veRL's ``loss_agg_mode``.

    Args:
        loss: (B, T) float tensor, the per-token loss.
        mask: (B, T) bool or 0/1 tensor of the tokens that count.
        loss_agg: one of ``LOSS_AGGREGATIONS``: token_mean, seq_mean_token_sum, seq_mean_token_mean.

    Returns:
        0-dim float tensor, the loss.

    Raises:
        ValueError: if ``loss_agg`` is not a known aggregation.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid names: {', '.join(LOSS_AGGREGATIONS)}")
    valid = mask.bool()
    if loss_agg == "token_mean":
        return masked_sum(loss, valid) / valid.sum().clamp(min=1)
    tokens = valid.sum(dim=1)
    responses = (tokens > 0).sum().clamp(min=1)
    if loss_agg == "seq_mean_token_sum":
        return masked_sum(loss, valid, dim=1).sum() / responses
    return (masked_sum(loss, valid, dim=1) / tokens.clamp(min=1)).sum() / responses  # seq_mean_token_mean


def aggregate_share(part: torch.Tensor, whole: torch.Tensor, loss_agg: str = "token_mean") -> torch.Tensor:
    """The weight of a part's ``aggregate_loss`` in its whole's, so that summing ``share *
    aggregate_loss(loss[rows], part)`` over parts that split the whole's rows gives
    ``aggregate_loss(loss, whole)``: gradient accumulation over micro-batches, exactly.

    Every aggregation is a sum over rows divided by a count of the whole: its valid tokens
    (``token_mean``) or its responses with a valid token (the ``seq_mean_*``). A part's own
    aggregate divides by its own count, so its share is its count over the whole's. Example,
    token_mean: rows with 3 and 1 valid tokens split into parts of one row each: shares 3/4 and 1/4.

    Args:
        part: (b, T) bool or 0/1 tensor, the valid tokens of the part's rows.
        whole: (B, T) bool or 0/1 tensor, the valid tokens of the whole.
        loss_agg: one of ``LOSS_AGGREGATIONS``.

    Returns:
        0-dim float tensor in [0, 1].

    Raises:
        ValueError: if ``loss_agg`` is not a known aggregation.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid names: {', '.join(LOSS_AGGREGATIONS)}")
    part, whole = part.bool(), whole.bool()
    if loss_agg == "token_mean":
        return part.sum() / whole.sum().clamp(min=1)
    return part.any(dim=1).sum() / whole.any(dim=1).sum().clamp(min=1)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    dual_clip: float | None = None,
    eps_clip_high: float | None = None,
    is_weights: torch.Tensor | None = None,
    loss_agg: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, averaged over all valid tokens (``loss_agg``).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347, eq. 7 (negated,
    as in CleanRL ppo.py). The ratio is clipped to [1 - eps_clip, 1 + eps_clip_high] (``eps_clip_high``
    None = eps_clip; a larger upper bound is DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476,
    eq. 10). With `dual_clip` (> 1), the loss of a negative-advantage token is also
    bounded by -adv * dual_clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    RL", arXiv:1912.09729, eq. 5. `is_weights` (B, T), detached, multiply each token's clipped loss:
    the off-policy correction of ``ray_ppo.algo.off_policy`` (then `old_log_probs` are the trainer's
    recomputed proximal log-probs, and the ratio is clipped around them).
    Stats (0-dim, detached): "clipfrac", the fraction of tokens whose clipped term is active, and
    "approx_kl", the k3 estimate of KL(old || new) (http://joschu.net/blog/kl-approx.html).

    Args:
        log_probs: (B, T) float tensor, the current policy's log-probs of the response tokens (with grad).
        old_log_probs: (B, T) float tensor, the log-probs the ratio is taken against (behaviour or proximal).
        advantages: (B, T) float tensor, the per-token advantages.
        mask: (B, T) bool or 0/1 tensor of the tokens of the loss.
        eps_clip: lower clip range: the ratio is kept >= 1 - eps_clip.
        dual_clip: bound on a negative-advantage token's loss, > 1; None for no dual clip.
        eps_clip_high: upper clip range (ratio <= 1 + eps_clip_high); None uses ``eps_clip``.
        is_weights: (B, T) float tensor of importance weights (detached here), or None.
        loss_agg: how the per-token losses are reduced (``aggregate_loss``).

    Returns:
        Tuple ``(loss, stats)``: ``loss`` a 0-dim float tensor; ``stats`` maps "clipfrac" and
        "approx_kl" to 0-dim detached float tensors.

    Raises:
        ValueError: if ``dual_clip`` is not > 1 or ``loss_agg`` is unknown.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    logratio = log_probs - old_log_probs
    ratio = torch.exp(logratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if dual_clip is not None:
        pg_loss3 = -advantages * dual_clip
        pg_loss = torch.where(advantages < 0, torch.min(pg_loss, pg_loss3), pg_loss)
    if is_weights is not None:
        pg_loss = pg_loss * is_weights.detach()
    loss = aggregate_loss(pg_loss, mask, loss_agg)
    return loss, _ratio_stats(pg_loss2 > pg_loss1, logratio, mask)


def _ratio_stats(clipped: torch.Tensor, logratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The policy losses' stats (0-dim, detached; 0 without a valid token): "clipfrac", the share of
    valid tokens where ``clipped``, and "approx_kl", the k3 estimate of KL(old || new) from the
    per-token log-ratios log(pi / pi_old) (http://joschu.net/blog/kl-approx.html)."""
    with torch.no_grad():
        approx_kl = torch.exp(logratio) - 1 - logratio
        return {"clipfrac": aggregate_loss(clipped.float(), mask), "approx_kl": aggregate_loss(approx_kl, mask)}


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    is_weights: torch.Tensor | None = None,
    loss_agg: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the clipped surrogate with one length-normalised importance ratio per sequence.

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071. The sequence ratio
    (eq. 7) s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean_t log(pi / pi_old)) over the
    sequence's valid tokens (``mask``: an environment's tokens are no part of it), clipped to
    [1 - eps_clip, 1 + eps_clip_high] (the paper's ranges are 3e-4 and 4e-4). In GSPO-token's form
    (eq. 13-14), s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]: equal to s_i in value, with the
    gradient sg[s_i] * grad log pi(y_i,t), so per-token advantages and weights fit in; with one
    advantage per sequence it is GSPO. The paper averages each sequence's tokens, then the
    sequences (``loss_agg=seq_mean_token_mean``). `is_weights` and the stats as ``policy_loss``.

    Args:
        log_probs: (B, T) float tensor, the current policy's log-probs of the response tokens (with grad).
        old_log_probs: (B, T) float tensor, the log-probs the ratio is taken against (behaviour or proximal).
        advantages: (B, T) float tensor, the per-token advantages.
        mask: (B, T) bool or 0/1 tensor of the tokens of the loss and of each sequence ratio.
        eps_clip: lower clip range of the sequence ratio.
        eps_clip_high: upper clip range; None uses ``eps_clip``.
        is_weights: (B, T) float tensor of importance weights (detached here), or None.
        loss_agg: how the per-token losses are reduced (``aggregate_loss``).

    Returns:
        Tuple ``(loss, stats)``: ``loss`` a 0-dim float tensor; ``stats`` maps "clipfrac" and
        "approx_kl" to 0-dim detached float tensors.

    Raises:
        ValueError: if ``loss_agg`` is unknown.
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    logratio = log_probs - old_log_probs
    valid = mask.bool()
    seq_logratio = masked_sum(logratio, valid, dim=-1) / valid.sum(dim=-1).clamp(min=1)  # log s_i
    seq_ratio = torch.exp(seq_logratio.detach().unsqueeze(-1) + log_probs - log_probs.detach())  # s_i,t
    pg_loss1 = -advantages * seq_ratio
    pg_loss2 = -advantages * torch.clamp(seq_ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if is_weights is not None:
        pg_loss = pg_loss * is_weights.detach()
    loss = aggregate_loss(pg_loss, mask, loss_agg)
    return loss, _ratio_stats(pg_loss2 > pg_loss1, logratio, mask)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip_high: float,
    is_weights: torch.Tensor | None = None,
    loss_agg: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE on every token, weighted by the clipped importance ratio without its gradient.

    MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4-5: J = mean over all tokens of
    sg(r_hat_t) * A_t * log pi(y_t), with r_hat_t = clip(r_t, 1 - eps_low, 1 + eps_high) and
    r_t = pi / pi_old. As in the paper's experiments there is no lower bound (eps_low large):
    r_hat_t = min(r_t, 1 + eps_clip_high). Unlike the PPO clip no token loses its gradient; a
    clipped weight only bounds it. The paper averages over every token of the group
    (``loss_agg=token_mean``). `is_weights` as ``policy_loss``; "clipfrac" is the share of
    tokens whose weight was clipped. The loss's value is -A * r_hat * log pi, not comparable with
    the clipped surrogate's; its gradient is the paper's.

    Args:
        log_probs: (B, T) float tensor, the current policy's log-probs of the response tokens (with grad).
        old_log_probs: (B, T) float tensor, the log-probs the ratio is taken against (behaviour or proximal).
        advantages: (B, T) float tensor, the per-token advantages.
        mask: (B, T) bool or 0/1 tensor of the tokens of the loss.
        eps_clip_high: the weight is capped at 1 + eps_clip_high.
        is_weights: (B, T) float tensor of importance weights (detached here), or None.
        loss_agg: how the per-token losses are reduced (``aggregate_loss``).

    Returns:
        Tuple ``(loss, stats)``: ``loss`` a 0-dim float tensor; ``stats`` maps "clipfrac" and
        "approx_kl" to 0-dim detached float tensors.

    Raises:
        ValueError: if ``loss_agg`` is unknown.
    """
    logratio = log_probs - old_log_probs
    ratio = torch.exp(logratio)
    clipped_ratio = torch.clamp(ratio, max=1.0 + eps_clip_high).detach()  # sg(r_hat)
    pg_loss = -advantages * clipped_ratio * log_probs
    if is_weights is not None:
        pg_loss = pg_loss * is_weights.detach()
    loss = aggregate_loss(pg_loss, mask, loss_agg)
    return loss, _ratio_stats(ratio > 1.0 + eps_clip_high, logratio, mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss 0.5 * (V - returns)^2 averaged over valid tokens, optionally clipped around the old values.

    As CleanRL ppo.py and OpenAI baselines ppo2: the clipped loss is the max of the unclipped and the
    clipped squared errors, with V_clipped = V_old + clamp(V - V_old, -value_clip, value_clip).
    Stats (0-dim, detached): "vf_clipfrac", the fraction of tokens where the clipped error is larger.

    Args:
        values: (B, T) float tensor, the critic's current values (with grad).
        old_values: (B, T) float tensor, the values recorded when the experience was made.
        returns: (B, T) float tensor, the regression targets.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.
        value_clip: clip range of V - V_old; None for the unclipped loss.

    Returns:
        Tuple ``(loss, stats)``: ``loss`` a 0-dim float tensor; ``stats`` maps "vf_clipfrac" to a
        0-dim float tensor (0 without ``value_clip``).
    """
    v_loss_unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * masked_mean(v_loss_unclipped, mask), {"vf_clipfrac": torch.zeros((), device=values.device)}
    v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    v_loss_clipped = (v_clipped - returns) ** 2
    v_loss = torch.max(v_loss_unclipped, v_loss_clipped)
    with torch.no_grad():
        vf_clipfrac = masked_mean((v_loss_clipped > v_loss_unclipped).float(), mask)
    return 0.5 * masked_mean(v_loss, mask), {"vf_clipfrac": vf_clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) finite logits -> (...) entropy of softmax(logits).

    H = -sum_a p_a log p_a = logsumexp(z) - sum_a p_a z_a, which never takes the log of a probability.

    Args:
        logits: (..., V) float tensor of finite logits, e.g. (B, T, V).

    Returns:
        (...) float tensor of entropies in nats, e.g. (B, T).
    """
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(..., V) logits and (...) int labels -> (...) log softmax(logits)[label], without a (..., V) log-softmax.

    Args:
        logits: (..., V) float tensor, e.g. (B, T, V).
        labels: (...) int64 tensor of token ids in [0, V), e.g. (B, T).

    Returns:
        (...) tensor of ``logits``' dtype, the log-prob of each label.
    """
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log r: unbiased per-sample estimate of KL(pi || pi_ref), can be negative.

    John Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.

    Args:
        log_probs: (B, T) float tensor, log-probs under pi of tokens sampled from pi.
        ref_log_probs: (B, T) float tensor, log-probs of the same tokens under pi_ref.

    Returns:
        (B, T) float tensor, the per-token estimate.
    """
    return log_probs - ref_log_probs


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log p - log r)^2: biased, low-variance, non-negative estimate of KL(pi || pi_ref).

    John Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.

    Args:
        log_probs: (B, T) float tensor, log-probs under pi of tokens sampled from pi.
        ref_log_probs: (B, T) float tensor, log-probs of the same tokens under pi_ref.

    Returns:
        (B, T) float tensor, the per-token estimate.
    """
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = (r/p - 1) - log(r/p): unbiased, non-negative estimate of KL(pi || pi_ref).

    John Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.

    Args:
        log_probs: (B, T) float tensor, log-probs under pi of tokens sampled from pi.
        ref_log_probs: (B, T) float tensor, log-probs of the same tokens under pi_ref.

    Returns:
        (B, T) float tensor, the per-token estimate.
    """
    log_ratio = ref_log_probs - log_probs
    return torch.exp(log_ratio) - 1 - log_ratio


KL_ESTIMATORS = dict(zip(KL_ESTIMATOR_NAMES, (kl_k1, kl_k2, kl_k3), strict=True))
"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi, by name."""


def compute_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) with the estimator named `estimator` (see KL_ESTIMATORS).

    Args:
        log_probs: (B, T) float tensor, log-probs under pi of tokens sampled from pi.
        ref_log_probs: (B, T) float tensor, log-probs of the same tokens under pi_ref.
        estimator: "k1", "k2" or "k3".

    Returns:
        (B, T) float tensor, the per-token estimate.

    Raises:
        ValueError: if ``estimator`` is not a known estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid names: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](log_probs, ref_log_probs)


def kl_penalized_rewards(
    reward: torch.Tensor, kl: torch.Tensor, action_mask: torch.Tensor, kl_coef: float,
    token_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t, plus the (B,) score `reward` at each row's last valid token.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593,
    section 2.2: R(x, y) = r(x, y) - beta * log(pi(y|x) / rho(y|x)), spread per token as in
    Stiennon et al. 2020, arXiv:2009.01325. `token_scores` (B, T), when given, replace the placed
    score: a multi-turn episode's reward of each turn sits at that turn's last token
    (``ray_ppo.makers.episodes``). Rewards are 0 at padding; every row needs a valid token.

    Args:
        reward: (B,) float tensor, the scalar score of each response.
        kl: (B, T) float tensor, the per-token KL estimate.
        action_mask: (B, T) bool or 0/1 tensor of the valid tokens.
        kl_coef: the KL coefficient beta.
        token_scores: (B, T) float tensor placing the score per token, or None to place ``reward`` at the last valid token.

    Returns:
        (B, T) float tensor of per-token rewards (``kl``'s dtype), 0 outside ``action_mask``.
    """
    valid = action_mask.bool()
    rewards = torch.where(valid, -kl_coef * kl, 0.0)
    if token_scores is not None:
        return rewards + torch.where(valid, token_scores.to(rewards.dtype), 0.0)
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    last = (positions * valid).argmax(dim=1, keepdim=True)
    return rewards.scatter_add(1, last, reward.to(rewards.dtype).unsqueeze(1))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens; nan if Var[returns] == 0.

    As CleanRL ppo.py: 1 is a perfect critic, 0 is no better than a constant, < 0 is worse.

    Args:
        values: (B, T) float tensor, the critic's values.
        returns: (B, T) float tensor, the returns they predict.
        mask: (B, T) bool or 0/1 tensor of the valid tokens.

    Returns:
        0-dim float tensor.
    """
    var_y = masked_var(returns, mask, unbiased=False)
    ev = 1 - masked_var(returns - values, mask, unbiased=False) / var_y
    return torch.where(var_y == 0, torch.full_like(ev, float("nan")), ev)

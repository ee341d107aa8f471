"""The PPO update: epochs x minibatches of actor and critic steps on one experience batch.

The policy objective is ``ppo.policy_loss``: the PPO clipped surrogate, GSPO or CISPO
(``ray_ppo.algo.functional``). With a ``ppo.off_policy`` correction the step first recomputes
the trainer's own log-probs of the batch (pi_old, no grad) and clips the ratio around them,
weighting each token by an importance weight built from pi_old / pi_behaviour
(``ray_ppo.algo.off_policy``). With ``algo.overlong_filter`` the truncated responses are
masked out of the policy loss. Critic-free estimators have no critic here.

Plain class, no Ray: the synchronous local loop and the Ray Train loop both drive it.

Shapes: B = rows of the step's ``ExperienceBatch``, P = its prompt width, R = its response width, M = rows of a minibatch.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn

from ray_ppo.algo import (
    ExperienceBatch,
    aggregate_loss,
    aggregate_share,
    behaviour_kl,
    cispo_loss,
    compute_kl,
    correction_stats,
    explained_variance,
    gspo_loss,
    importance_weights,
    kl_by_staleness,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    value_loss,
)
from ray_ppo.config import Config
from ray_ppo.config.preflight import trainer_bfloat16, warn_slow_bfloat16
from ray_ppo.models import action_log_probs, action_values
from ray_ppo.models.hf import action_log_probs_and_entropy
from ray_ppo.models.packing import micro_batches, packs, pass_tokens, prompt_groups
from ray_ppo.train.strategies import Strategy

STALE_KL_PREFIX = "behaviour_kl_stale_"
"""``behaviour_kl_stale_<s>``: KL(behaviour || proximal) over the items of staleness s (nan where
a rank has none; ``drop_absent`` removes the key when no rank had such items)."""


def drop_absent(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics without the per-staleness statistics that no item of the step had (nan).

    Args:
        metrics: name -> value, e.g. a step's metrics after the all-reduce.

    Returns:
        A new dict without the nan ``behaviour_kl_stale_<s>`` keys.
    """
    return {k: v for k, v in metrics.items() if not (k.startswith(STALE_KL_PREFIX) and math.isnan(v))}


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True only if ``flag`` is true on every rank (a collective when a process group exists).

    Args:
        flag: this rank's value.
        device: the device of the process group's tensors.

    Returns:
        The logical AND of ``flag`` over the ranks.
    """
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def all_ranks_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks (a collective when a process group exists).

    Args:
        value: this rank's value.
        device: the device of the process group's tensors.

    Returns:
        The maximum of ``value`` over the ranks.
    """
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    t = torch.tensor([value], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def lr_lambda(schedule: str, warmup_steps: int, total_updates: int):
    """Multiplier of the base learning rate after ``n`` optimizer updates: linear warm-up, then
    constant, linear decay to 0, or cosine decay to 0 (Loshchilov & Hutter 2017, SGDR).

    Args:
        schedule: "linear", "cosine" or anything else for constant (``trainer.lr_schedule``).
        warmup_steps: the number of warm-up updates.
        total_updates: the number of optimizer updates of the run.

    Returns:
        A function of the update count ``n`` -> the float multiplier, for ``LambdaLR``.
    """
    def factor(n: int) -> float:
        if n < warmup_steps:
            return (n + 1) / warmup_steps
        progress = min(1.0, (n - warmup_steps) / max(1, total_updates - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return factor


class Proximal:
    """A step's proximal log-probs (B, R), the anchor of the clipped ratio. Rows ``first`` (the
    step's first minibatch's) are filled from that minibatch's own update: its forward pass runs on
    the weights of the step's start, so they equal a separate no-grad pass, which is saved. With
    ``interpolate`` (``ppo.proximal=interpolate``) every other row is filled at its own first
    update too, by AReaL's approximation: ``log pi_b + alpha * (log pi_theta - log pi_b)``.

    Args:
        anchor: (B, R) float tensor of proximal log-probs (rows still to fill are overwritten).
        mask: (B, R) bool tensor, the batch's action mask.
        first: (M,) int64 row indices of the step's first minibatch, or None if no row waits for it.
        interpolate: (behaviour log-probs (B, R), alpha (B, 1)) to fill the other rows with, or None
            (they are filled already: a forward pass).
    """

    def __init__(self, anchor: torch.Tensor, mask: torch.Tensor, first: torch.Tensor | None = None,
                 interpolate: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.anchor, self.mask, self.first, self.interpolate = anchor, mask, first, interpolate
        self.pending = torch.zeros(anchor.shape[0], dtype=torch.bool, device=anchor.device)
        if first is not None:
            self.pending[first] = True
        if interpolate is not None:
            self.pending[:] = True

    def rows(self, idx: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """The anchor of rows ``idx``, whose log-probs under the updating actor are ``log_probs``
        (the first minibatch may come in micro-batches, before its update).

        Args:
            idx: (M,) int64 row indices of the minibatch.
            log_probs: (M, R) float tensor, the actor's log-probs of those rows (detached here).

        Returns:
            (M, R) float tensor, the proximal log-probs of those rows.

        Raises:
            RuntimeError: if the first minibatch's rows are pending and ``idx`` is not among them.
        """
        if self.first is not None:
            if not bool(torch.isin(idx, self.first).all()):
                raise RuntimeError("the proximal log-probs of the step's first minibatch must come from its own "
                                   "update, the step's first")
            self.first = self.first[~torch.isin(self.first, idx)]
            self.first = self.first if self.first.numel() else None
            estimate = log_probs.detach()
        elif self.interpolate is not None and bool(self.pending[idx].any()):
            behaviour, alpha = (t[idx] for t in self.interpolate)
            estimate = behaviour + alpha * (log_probs.detach() - behaviour)
        else:
            return self.anchor[idx]
        fill = self.pending[idx].unsqueeze(1) & self.mask[idx].bool()
        self.anchor[idx] = torch.where(fill, estimate, self.anchor[idx])
        self.pending[idx] = False
        return self.anchor[idx]


class PPOLearner:
    """Owns the actor and critic being trained, their optimizers and schedules.

    Responsibilities:
      - wrap the models with the strategy;
      - recompute the trainer's log-probs of the batch when ``off_policy`` needs them;
      - run ``ppo_epochs`` passes of minibatch actor (``ppo.policy_loss`` + entropy bonus, and the
        KL term with ``kl_in="loss"``) and critic (clipped value loss) updates on one ``ExperienceBatch``;
      - return the step's metrics.

    The settings are the run's ``Config``: ``trainer.*`` (optimizers, schedule, epochs, minibatches),
    ``ppo.*`` (the objective), ``algo.*`` (the estimator and the overlong settings),
    ``maker.temperature`` and ``maker.max_new_tokens``.
    ``critic`` is None for the critic-free estimators (no critic optimizer, no value loss).
    ``kl_coef`` is the coefficient of the KL loss term (``kl_in="loss"``); the loop sets it from
    its KL controller before each step.

    Args:
        actor: the policy to train.
        critic: the value model to train, or None for a critic-free estimator.
        strategy: how the models are wrapped, stepped and synchronised.
        cfg: the run's configuration.
        seed: the seed of the minibatch shuffling.
    """

    def __init__(self, actor: nn.Module, critic: nn.Module | None, strategy: Strategy, cfg: Config, seed: int = 0):
        self.strategy = strategy
        self.trainer, self.ppo, self.algo, self.estimator = cfg.trainer, cfg.ppo, cfg.algo, cfg.algo.advantage
        self.temperature = cfg.maker.temperature  # the log-probs are of the distribution the makers sample from
        self.max_new_tokens = cfg.maker.max_new_tokens
        t = cfg.trainer
        self.actor = strategy.wrap(actor.train())
        self.critic = strategy.wrap(critic.train()) if critic is not None else None
        self.actor_optim = strategy.make_optimizer(self.actor, t.actor_lr, t.weight_decay)
        schedule = lr_lambda(t.lr_schedule, t.warmup_steps, cfg.total_updates)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_optim, schedule)
        self.critic_optim = self.critic_sched = None
        if self.critic is not None:
            self.critic_optim = strategy.make_optimizer(self.critic, t.critic_lr, t.weight_decay)
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_optim, schedule)
        self.kl_coef = 0.0
        self.generator = torch.Generator().manual_seed(seed)
        self.device = strategy.device
        if setting := trainer_bfloat16(cfg):
            warn_slow_bfloat16(self.device.type, setting)
        self.nonfinite_updates = 0  # updates skipped for a non-finite loss or gradient, whole run
        self.work = {"tokens_computed": 0.0, "tokens_trained": 0.0, "optimizer_s": 0.0}  # this step's, so far
        self.consecutive_nonfinite = 0

    def train_step(self, batch: ExperienceBatch, version: int | None = None,
                   behaviour_is_policy: bool = False) -> dict[str, float]:
        """PPO epochs over ``batch``; returns mean losses and statistics. ``version`` is the
        trainer's policy version (for the off-policy statistics by staleness).
        ``behaviour_is_policy``: this very actor, with its present weights, sampled the batch and
        computed its log-probs (the synchronous loop). The proximal policy of ``tis`` /
        ``decoupled`` is then the behaviour policy, so its extra forward pass is skipped (weights
        1, behaviour KL 0). Not for a detached maker's batch: its copy may differ (int8, an engine's
        log-probs, LoRA dropout) even at staleness 0.

        Args:
            batch: the step's experience: (B, P+R) sequences, (B, R) float32 per-token fields.
            version: the trainer's policy version, or None to skip the statistics by staleness.
            behaviour_is_policy: this actor sampled the batch and computed its log-probs, as it is now.

        Returns:
            Metric name -> float: the losses and statistics averaged over the updates, learning
            rates, and the off-policy, overlong and non-finite-update statistics.

        Raises:
            FloatingPointError: after more than ``trainer.max_nonfinite_updates`` non-finite updates in a row.
        """
        self.work = dict.fromkeys(self.work, 0.0)
        batch = batch.to(self.device)
        if self._whitens():
            batch.advantages = masked_whiten(batch.advantages, batch.action_mask)
        size = self.trainer.mini_batch_size
        orders = [self._order(batch) for _ in range(self.trainer.ppo_epochs)]
        proximal = self._proximal(batch, behaviour_is_policy, first=orders[0][:size].to(self.device), version=version)
        sums: dict[str, float] = {}
        updates, skipped_before = 0, self.nonfinite_updates
        for order in orders:
            for start in range(0, batch.batch_size, size):
                idx = order[start:start + size].to(self.device)
                minibatch = batch.select(idx)
                stats = self._actor_update(minibatch, proximal, idx)
                if self.critic is not None:
                    stats.update(self._critic_update(minibatch))
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        metrics = self._off_policy_metrics(batch, proximal.anchor, version)
        metrics.update(self._overlong_metrics(batch))
        metrics.update({key: value / updates for key, value in sums.items()})
        metrics["actor_lr"] = self.actor_sched.get_last_lr()[0]
        if self.critic is not None:
            metrics["critic_lr"] = self.critic_sched.get_last_lr()[0]
            metrics["explained_variance"] = float(explained_variance(batch.values, batch.returns, batch.action_mask))
        metrics["nonfinite_updates"] = float(self.nonfinite_updates - skipped_before)
        metrics.update(self.work)
        return metrics

    def _forward(self):
        """The context of a forward pass: bfloat16 autocast with ``trainer.autocast`` (the weights stay
        float32; logits and values are read in float32), else nothing."""
        if self.trainer.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _order(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B,) a random order of the batch's rows, cut into minibatches in turn. With packed passes
        (``model.packing``) the rows that share a prompt stay together, in prompt groups in random
        order, so a minibatch computes each prompt once (``ray_ppo.models.packing``)."""
        if not packs(self.actor):
            return torch.randperm(batch.batch_size, generator=self.generator)
        groups = prompt_groups(batch.sequences, batch.attention_mask, batch.num_actions)
        shuffled = torch.randperm(len(groups), generator=self.generator).tolist()
        return torch.tensor([row for g in shuffled for row in groups[g]], dtype=torch.long)

    def _whitens(self) -> bool:
        """GAE: as ``ppo.whiten_advantages``; REINFORCE++: always (its batch normalisation); GRPO
        and RLOO: never (their advantages are already normalised within each group)."""
        if self.estimator in ("grpo", "rloo"):
            return False
        return self.ppo.whiten_advantages or self.estimator == "reinforce_pp"

    @torch.no_grad()
    def _log_probs(self, batch: ExperienceBatch) -> torch.Tensor:
        """(B, R) log-probs of the batch's responses under the current actor, minibatch by minibatch."""
        out = []
        for start in range(0, batch.batch_size, self.trainer.mini_batch_size):
            mb = batch.select(torch.arange(start, min(start + self.trainer.mini_batch_size, batch.batch_size)))
            self._count(mb, self.actor)
            with self._forward():
                out.append(action_log_probs(self.actor, mb.sequences, mb.attention_mask, mb.num_actions,
                                            self.temperature))
        return torch.where(batch.action_mask.bool(), torch.cat(out), 0.0)

    def _proximal(self, batch: ExperienceBatch, behaviour_is_policy: bool, first: torch.Tensor,
                  version: int | None = None) -> Proximal:
        """The log-probs the ratio is clipped around, for the step.

        ``none``: the maker's behaviour log-probs. The corrections: the trainer's own log-probs at
        the start of the step. The rows of the step's first minibatch (``first``) come from that
        minibatch's own update, whose forward pass runs before any weight of the step changes;
        the other rows from one no-grad forward pass now (none with a single minibatch), or with
        ``ppo.proximal=interpolate`` (and the trainer's ``version`` known) from AReaL's
        interpolation at their own first update, with alpha = s / (s + 1) for an item of staleness
        s (its oldest token's): 0 for fresh experience, whose behaviour policy is the proximal one.
        With ``behaviour_is_policy`` they are the behaviour log-probs (no forward)."""
        behaviour = batch.action_log_probs
        if self.ppo.off_policy == "none" or behaviour_is_policy:
            return Proximal(behaviour, batch.action_mask)
        anchor = torch.zeros_like(behaviour)
        if self.ppo.proximal == "interpolate" and version is not None:
            staleness = (version - batch.policy_version).clamp(min=0).to(behaviour.dtype).unsqueeze(1)
            return Proximal(anchor, batch.action_mask, first, interpolate=(behaviour, staleness / (staleness + 1)))
        rest = torch.ones(batch.batch_size, dtype=torch.bool, device=behaviour.device)
        rest[first] = False
        if bool(rest.any()):
            rows = rest.nonzero().flatten()
            anchor[rows] = self._log_probs(batch.select(rows))
        return Proximal(anchor, batch.action_mask, first)

    def _off_policy_metrics(self, batch: ExperienceBatch, old: torch.Tensor, version: int | None) -> dict[str, float]:
        """Importance-weight statistics and the behaviour KL (``tis`` / ``decoupled``), overall and
        by staleness (given ``version``), from the step's proximal log-probs ``old``."""
        p, behaviour, mask = self.ppo, batch.action_log_probs, batch.action_mask
        if p.off_policy == "none":
            return {}
        metrics = correction_stats(p.off_policy, old, behaviour, mask, p.importance_cap, p.importance_band)
        kl = behaviour_kl(old, behaviour)
        metrics["behaviour_kl"] = float(masked_mean(kl, mask))
        if version is not None:
            staleness = version - batch.policy_version
            for s, value in kl_by_staleness(kl, mask, staleness, p.max_staleness).items():
                metrics[f"{STALE_KL_PREFIX}{s}"] = value
        return metrics

    def _overlong_metrics(self, batch: ExperienceBatch) -> dict[str, float]:
        """``algo.overlong_buffer``: the share of responses whose length entered the buffer and their mean
        penalty; ``algo.overlong_filter``: the share of truncated responses, masked out of the loss."""
        a, metrics = self.algo, {}
        if a.overlong_buffer:
            penalty = overlong_penalty(batch.action_mask.sum(dim=1), self.max_new_tokens, a.overlong_buffer,
                                       a.overlong_penalty)
            metrics["overlong_penalized_frac"] = float((penalty < 0).float().mean())
            metrics["overlong_penalty_mean"] = float(penalty.mean())
        if a.overlong_filter:
            metrics["overlong_filtered_frac"] = float(self._truncated(batch).float().mean())
        return metrics

    @staticmethod
    def _truncated(batch: ExperienceBatch) -> torch.Tensor:
        if batch.truncated is None:
            return torch.zeros(batch.batch_size, dtype=torch.bool, device=batch.action_mask.device)
        return batch.truncated

    def _loss_mask(self, mb: ExperienceBatch) -> torch.Tensor:
        """The tokens of the policy loss: the policy's own, without the truncated responses' with
        ``algo.overlong_filter`` (DAPO's overlong filtering)."""
        if not self.algo.overlong_filter:
            return mb.action_mask
        return mb.action_mask & ~self._truncated(mb).unsqueeze(1)

    def _weights(self, anchor: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Importance weights of ``ppo.off_policy`` from pi_proximal / pi_behaviour (None for ``none``)."""
        p = self.ppo
        if p.off_policy == "none":
            return None
        return importance_weights(p.off_policy, anchor, behaviour, mask, p.importance_cap, p.importance_band)

    def _policy_loss(self, log_probs: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``ppo.policy_loss`` and its stats."""
        p = self.ppo
        if p.policy_loss == "gspo":
            return gspo_loss(log_probs, anchor, advantages, mask, p.eps_clip, p.eps_clip_high, weights, p.loss_agg)
        if p.policy_loss == "cispo":
            eps_clip_high = p.eps_clip if p.eps_clip_high is None else p.eps_clip_high
            return cispo_loss(log_probs, anchor, advantages, mask, eps_clip_high, weights, p.loss_agg)
        return policy_loss(log_probs, anchor, advantages, mask, p.eps_clip, p.dual_clip,
                           eps_clip_high=p.eps_clip_high, is_weights=weights, loss_agg=p.loss_agg)

    def _micro_batches(self, mb: ExperienceBatch, model: nn.Module) -> list[torch.Tensor | None]:
        """Row indices of ``mb``'s micro-batches under ``trainer.max_tokens_per_microbatch``, as many
        on every rank; [None] (the whole minibatch in one pass) without a budget."""
        budget = self.trainer.max_tokens_per_microbatch
        if not budget:
            return [None]
        cut = lambda at_least=1: micro_batches(mb.sequences, mb.attention_mask, mb.num_actions, budget,  # noqa: E731
                                               packs(model), at_least)
        parts = cut()
        most = all_ranks_max(len(parts), self.device)
        parts = cut(most) if most > len(parts) else parts
        return [None] if len(parts) == 1 else [torch.tensor(p, dtype=torch.long, device=self.device) for p in parts]

    def _actor_update(self, mb: ExperienceBatch, proximal: Proximal, idx: torch.Tensor) -> dict[str, float]:
        """One policy update on minibatch ``mb`` (rows ``idx`` of the step's batch)."""
        mask = self._loss_mask(mb)

        def loss_of(part: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
            if part is None:
                return self._actor_loss(mb, proximal, idx, mask, mask)
            return self._actor_loss(mb.select(part), proximal, idx[part], mask[part], mask)

        return self._update(mb, loss_of, self.actor, self.actor_optim, self.actor_sched, "actor")

    def _actor_loss(self, mb: ExperienceBatch, proximal: Proximal, idx: torch.Tensor, mask: torch.Tensor,
                    whole: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of micro-batch ``mb`` (rows ``idx`` of the step's batch, loss tokens
        ``mask``), weighted by its share of its minibatch's (loss tokens ``whole``): the weighted
        losses of a minibatch's micro-batches sum to its loss, and so do their statistics."""
        p = self.ppo
        share = lambda agg: aggregate_share(mask, whole, agg)  # noqa: E731
        self._count(mb, self.actor)
        self.work["tokens_trained"] += float(mask.sum())
        with self._forward():
            log_probs, entropies = action_log_probs_and_entropy(self.actor, mb.sequences, mb.attention_mask,
                                                                mb.num_actions, self.temperature, entropy=True)
        anchor = proximal.rows(idx, log_probs)
        weights = self._weights(anchor, mb.action_log_probs, mb.action_mask)
        pg_loss, stats = self._policy_loss(log_probs, anchor, mb.advantages, mask, weights)
        if p.entropy_coef == 0:  # reported only: no backward pass through the vocabulary-wide softmax
            entropies = entropies.detach()
        pg_loss, entropy = share(p.loss_agg) * pg_loss, share("token_mean") * aggregate_loss(entropies, mask)
        loss = pg_loss - p.entropy_coef * entropy
        out = {"policy_loss": pg_loss.item(), "entropy": entropy.item(),
               "clipfrac": float(share("token_mean") * stats["clipfrac"]),
               "approx_kl": float(share("token_mean") * stats["approx_kl"])}
        if p.kl_in == "loss" and p.uses_reference:
            kl = compute_kl(log_probs, mb.ref_log_probs, p.kl_estimator)
            kl_loss = share(p.loss_agg) * aggregate_loss(kl, mask, p.loss_agg)
            loss = loss + self.kl_coef * kl_loss
            out["kl_loss"] = kl_loss.item()
        return loss, out

    def _critic_update(self, mb: ExperienceBatch) -> dict[str, float]:
        """One value update on minibatch ``mb``."""

        def loss_of(part: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
            sub = mb if part is None else mb.select(part)
            self._count(sub, self.critic)
            with self._forward():
                values = action_values(self.critic, sub.sequences, sub.attention_mask, sub.num_actions)
            vf_loss, stats = value_loss(values, sub.values, sub.returns, sub.action_mask, self.ppo.value_clip)
            share = aggregate_share(sub.action_mask, mb.action_mask)  # value_loss is a token mean
            return share * vf_loss, {"value_loss": float(share * vf_loss), "vf_clipfrac": float(share * stats["vf_clipfrac"])}

        return self._update(mb, loss_of, self.critic, self.critic_optim, self.critic_sched, "critic")

    def _update(self, mb: ExperienceBatch, loss_of, model: nn.Module, optim, sched, what: str) -> dict[str, float]:
        """One optimizer update of ``model`` on minibatch ``mb``, its gradient accumulated over the
        micro-batches of ``trainer.max_tokens_per_microbatch``: ``loss_of(part)`` gives a part's loss,
        already weighted by its share of the minibatch, and its statistics, which sum over the parts."""
        sums: dict[str, float] = {}
        finite = True
        for part in self._micro_batches(mb, model):
            loss, stats = loss_of(part)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            finite = self._backward(loss, model, optim)
            if not finite:
                break
        grad_norm = self._step(finite, loss, model, optim, sched, what)
        return {**sums, f"{what}_grad_norm": grad_norm}

    def _count(self, mb: ExperienceBatch, model: nn.Module) -> None:
        """Add the tokens a pass of ``model`` over ``mb`` computes to the step's ``tokens_computed``."""
        self.work["tokens_computed"] += pass_tokens(mb.sequences, mb.attention_mask, mb.num_actions,
                                                    list(range(mb.batch_size)), packs(model))

    def _backward(self, loss: torch.Tensor, model: nn.Module, optim) -> bool:
        """Backpropagate ``loss`` (gradients accumulate) if it is finite on every rank; returns whether it was."""
        finite = all_ranks_agree(bool(torch.isfinite(loss.detach())), self.device)
        if finite:
            self.strategy.backward(loss, model, optim)
        return finite

    def _step(self, finite: bool, loss: torch.Tensor, model: nn.Module, optim, sched, what: str) -> float:
        """clip -> step after an update's backward passes; returns the gradient norm.

        If a loss (``finite`` false) or the gradient norm is non-finite on any rank, every rank
        drops its gradients and skips the step (weights unchanged; counted in ``nonfinite_updates``).
        More than ``max_nonfinite_updates`` such updates in a row end the run.
        """
        grad_norm, start = float("nan"), time.perf_counter()
        if finite:
            grad_norm = self.strategy.clip_grad_norm(model, optim, self.trainer.max_grad_norm)
            finite = math.isfinite(grad_norm)  # computed from synchronised gradients: equal on every rank
        if finite:
            self.strategy.step(optim, model)
            self.work["optimizer_s"] += time.perf_counter() - start
            self.consecutive_nonfinite = 0
        else:
            optim.zero_grad(set_to_none=True)
            self.nonfinite_updates += 1
            self.consecutive_nonfinite += 1
            if self.consecutive_nonfinite > self.trainer.max_nonfinite_updates:
                raise FloatingPointError(
                    f"{self.consecutive_nonfinite} optimizer updates in a row had a non-finite loss or gradient "
                    f"(last: {what} loss={loss.item()}, grad norm={grad_norm}); lower the learning rate, check the "
                    f"reward function, or raise trainer.max_nonfinite_updates")
        sched.step()
        return grad_norm

    def full_state_dict(self) -> dict:
        """Collective on every rank: full optimizer states (rank 0; ``{}`` elsewhere), schedulers and
        the minibatch RNG — what a checkpoint needs besides the weights.

        Returns:
            Dict with ``actor``, ``actor_sched``, ``generator``, and with a critic ``critic``, ``critic_sched``.
        """
        s = self.strategy
        state = {"actor": s.full_optimizer_state_dict(self.actor, self.actor_optim),
                 "actor_sched": self.actor_sched.state_dict(), "generator": self.generator.get_state()}
        if self.critic is not None:
            state.update(critic=s.full_optimizer_state_dict(self.critic, self.critic_optim),
                         critic_sched=self.critic_sched.state_dict())
        return state

    def load_state(self, state: dict) -> None:
        """Restore what ``ray_ppo.train.loop`` checkpoints: full optimizer states (strategy-aware),
        schedulers and the minibatch RNG.

        Args:
            state: a dict that ``full_state_dict`` returned.

        Raises:
            ValueError: if the learner has a critic and ``state`` has no critic optimizer state.
        """
        self.strategy.load_optimizer_state(self.actor, self.actor_optim, state["actor"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError("the checkpoint has no critic optimizer state (it was made by a critic-free "
                                 "algo.advantage); resume it with the same algo.advantage")
            self.strategy.load_optimizer_state(self.critic, self.critic_optim, state["critic"])
            self.critic_sched.load_state_dict(state["critic_sched"])
        self.generator.set_state(state["generator"])

"""The PPO update: epochs x minibatches of actor and critic steps on one experience batch.

Plain class, no Ray: the synchronous local loop and the Ray Train loop both drive it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ray_ppo.algo import (
    ExperienceBatch,
    entropy_from_logits,
    explained_variance,
    log_probs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from ray_ppo.models import action_logits, action_values
from ray_ppo.train.strategies import Strategy


@dataclass
class LearnerParams:
    """The ``trainer.*`` and ``ppo.*`` settings the update needs."""

    actor_lr: float = 1e-5
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_updates: int = 1
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    mini_batch_size: int = 16
    eps_clip: float = 0.2
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    whiten_advantages: bool = True
    temperature: float = 1.0
    max_nonfinite_updates: int = 10


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True only if ``flag`` is true on every rank (a collective when a process group exists)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def lr_lambda(schedule: str, warmup_steps: int, total_updates: int):
    """Multiplier of the base learning rate after ``n`` optimizer updates: linear warm-up, then
    constant, linear decay to 0, or cosine decay to 0 (Loshchilov & Hutter 2017, SGDR)."""
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


class PPOLearner:
    """Owns the actor and critic being trained, their optimizers and schedules.

    Responsibilities:
      - wrap the models with the strategy;
      - run ``ppo_epochs`` passes of minibatch actor (clipped surrogate + entropy bonus) and
        critic (clipped value loss) updates on one ``ExperienceBatch``;
      - return the step's metrics.
    """

    def __init__(self, actor: nn.Module, critic: nn.Module, strategy: Strategy, params: LearnerParams, seed: int = 0):
        self.strategy, self.params = strategy, params
        self.actor, self.critic = strategy.wrap(actor.train()), strategy.wrap(critic.train())
        self.actor_optim = strategy.make_optimizer(self.actor, params.actor_lr, params.weight_decay)
        self.critic_optim = strategy.make_optimizer(self.critic, params.critic_lr, params.weight_decay)
        schedule = lr_lambda(params.lr_schedule, params.warmup_steps, params.total_updates)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_optim, schedule)
        self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_optim, schedule)
        self.generator = torch.Generator().manual_seed(seed)
        self.device = strategy.device
        self.nonfinite_updates = 0  # updates skipped for a non-finite loss or gradient, whole run
        self.consecutive_nonfinite = 0

    def train_step(self, batch: ExperienceBatch) -> dict[str, float]:
        """PPO epochs over ``batch``; returns mean losses and statistics."""
        batch = batch.to(self.device)
        if self.params.whiten_advantages:
            batch.advantages = masked_whiten(batch.advantages, batch.action_mask)
        sums: dict[str, float] = {}
        updates, skipped_before = 0, self.nonfinite_updates
        for _ in range(self.params.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=self.generator)
            for start in range(0, batch.batch_size, self.params.mini_batch_size):
                minibatch = batch.select(order[start:start + self.params.mini_batch_size])
                for key, value in {**self._actor_update(minibatch), **self._critic_update(minibatch)}.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        metrics = {key: value / updates for key, value in sums.items()}
        metrics["actor_lr"] = self.actor_sched.get_last_lr()[0]
        metrics["critic_lr"] = self.critic_sched.get_last_lr()[0]
        metrics["explained_variance"] = float(explained_variance(batch.values, batch.returns, batch.action_mask))
        metrics["nonfinite_updates"] = float(self.nonfinite_updates - skipped_before)
        return metrics

    def _actor_update(self, mb: ExperienceBatch) -> dict[str, float]:
        p = self.params
        logits = action_logits(self.actor, mb.sequences, mb.attention_mask, mb.num_actions, p.temperature)
        log_probs = log_probs_from_logits(logits, mb.sequences[:, -mb.num_actions:])
        pg_loss, stats = policy_loss(log_probs, mb.action_log_probs, mb.advantages, mb.action_mask, p.eps_clip, p.dual_clip)
        entropy = masked_mean(entropy_from_logits(logits), mb.action_mask)
        loss = pg_loss - p.entropy_coef * entropy
        grad_norm = self._optimize(loss, self.actor, self.actor_optim, self.actor_sched, "actor")
        return {"policy_loss": pg_loss.item(), "entropy": entropy.item(), "clipfrac": float(stats["clipfrac"]),
                "approx_kl": float(stats["approx_kl"]), "actor_grad_norm": grad_norm}

    def _critic_update(self, mb: ExperienceBatch) -> dict[str, float]:
        p = self.params
        values = action_values(self.critic, mb.sequences, mb.attention_mask, mb.num_actions)
        vf_loss, stats = value_loss(values, mb.values, mb.returns, mb.action_mask, p.value_clip)
        grad_norm = self._optimize(vf_loss, self.critic, self.critic_optim, self.critic_sched, "critic")
        return {"value_loss": vf_loss.item(), "vf_clipfrac": float(stats["vf_clipfrac"]), "critic_grad_norm": grad_norm}

    def _optimize(self, loss: torch.Tensor, model: nn.Module, optim, sched, what: str) -> float:
        """backward -> clip -> step; returns the gradient norm.

        If the loss or the gradient norm is non-finite on any rank, every rank drops its
        gradients and skips the step (weights unchanged; counted in ``nonfinite_updates``).
        More than ``max_nonfinite_updates`` such updates in a row end the run.
        """
        grad_norm = float("nan")
        finite = all_ranks_agree(bool(torch.isfinite(loss.detach())), self.device)
        if finite:
            self.strategy.backward(loss, model, optim)
            grad_norm = self.strategy.clip_grad_norm(model, optim, self.params.max_grad_norm)
            finite = math.isfinite(grad_norm)  # computed from synchronised gradients: equal on every rank
        if finite:
            self.strategy.step(optim, model)
            self.consecutive_nonfinite = 0
        else:
            optim.zero_grad(set_to_none=True)
            self.nonfinite_updates += 1
            self.consecutive_nonfinite += 1
            if self.consecutive_nonfinite > self.params.max_nonfinite_updates:
                raise FloatingPointError(
                    f"{self.consecutive_nonfinite} optimizer updates in a row had a non-finite loss or gradient "
                    f"(last: {what} loss={loss.item()}, grad norm={grad_norm}); lower the learning rate, check the "
                    f"reward function, or raise trainer.max_nonfinite_updates")
        sched.step()
        return grad_norm

    def full_state_dict(self) -> dict:
        """Collective on every rank: full optimizer states (rank 0; ``{}`` elsewhere), schedulers and
        the minibatch RNG — what a checkpoint needs besides the weights."""
        s = self.strategy
        return {"actor": s.full_optimizer_state_dict(self.actor, self.actor_optim),
                "critic": s.full_optimizer_state_dict(self.critic, self.critic_optim),
                "actor_sched": self.actor_sched.state_dict(), "critic_sched": self.critic_sched.state_dict(),
                "generator": self.generator.get_state()}

    def load_state(self, state: dict) -> None:
        """Restore what ``train.loop`` checkpoints: full optimizer states (strategy-aware),
        schedulers and the minibatch RNG."""
        self.strategy.load_optimizer_state(self.actor, self.actor_optim, state["actor"])
        self.strategy.load_optimizer_state(self.critic, self.critic_optim, state["critic"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        self.critic_sched.load_state_dict(state["critic_sched"])
        self.generator.set_state(state["generator"])

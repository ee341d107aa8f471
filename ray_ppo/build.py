"""Build the run's components from a ``Config``: models, experience maker, learner settings.

Shared by the synchronous local loop, the maker actors and the Ray Train loop, so the three
build exactly the same things from the same config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ray_ppo.algo import needs_critic
from ray_ppo.config import Config, ConfigError
from ray_ppo.makers.experience import AdvantageParams, ExperienceMaker
from ray_ppo.models.lora import apply_lora
from ray_ppo.models.hf import disable_dropout
from ray_ppo.models import Critic, RewardModel, SamplingParams, load_actor, load_reward_fn, load_tokenizer
from ray_ppo.models.tiny import resolve_pretrained
from ray_ppo.train.learner import LearnerParams


def resolve_config(cfg: Config) -> Config:
    """Turn machine-local names into absolute paths before the config travels to other processes:
    ``tiny`` model names to the built model's directory, a relative ``data.path`` to an absolute one."""
    model = dataclasses.replace(
        cfg.model,
        pretrained=resolve_pretrained(cfg.model.pretrained),
        tokenizer=resolve_pretrained(cfg.model.tokenizer),
        critic_pretrained=resolve_pretrained(cfg.model.critic_pretrained),
        reward_pretrained=resolve_pretrained(cfg.model.reward_pretrained),
    )
    data = cfg.data
    if data.path and "://" not in data.path and Path(data.path).exists():
        data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
    return dataclasses.replace(cfg, model=model, data=data)


def sampling_params(cfg: Config) -> SamplingParams:
    m = cfg.maker
    return SamplingParams(m.max_new_tokens, m.temperature, m.top_k, m.top_p)


def advantage_params(cfg: Config, kl_coef: float | None = None) -> AdvantageParams:
    p = cfg.ppo
    return AdvantageParams(p.kl_coef if kl_coef is None else kl_coef, p.kl_estimator, p.gamma, p.lam,
                           estimator=cfg.algo.advantage, samples_per_prompt=cfg.maker.samples_per_prompt,
                           group_norm_std=cfg.algo.group_norm_std, kl_in=p.kl_in)


def total_updates(cfg: Config) -> int:
    """Optimizer updates over the whole run (for learning-rate schedules)."""
    t = cfg.trainer
    return t.total_steps * t.ppo_epochs * (t.train_batch_size // t.mini_batch_size)


def learner_params(cfg: Config) -> LearnerParams:
    t, p = cfg.trainer, cfg.ppo
    return LearnerParams(
        actor_lr=t.actor_lr, critic_lr=t.critic_lr, weight_decay=t.weight_decay, lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps, total_updates=total_updates(cfg), max_grad_norm=t.max_grad_norm,
        ppo_epochs=t.ppo_epochs, mini_batch_size=t.mini_batch_size, eps_clip=p.eps_clip, dual_clip=p.dual_clip,
        value_clip=p.value_clip, entropy_coef=p.entropy_coef, whiten_advantages=p.whiten_advantages,
        temperature=cfg.maker.temperature, max_nonfinite_updates=t.max_nonfinite_updates,
        eps_clip_high=p.eps_clip_high, loss_agg=p.loss_agg, off_policy=p.off_policy,
        is_cap=p.tis_cap if p.off_policy == "tis" else p.decoupled_cap, max_staleness=p.max_staleness,
        kl_in=p.kl_in, kl_estimator=p.kl_estimator, estimator=cfg.algo.advantage,
    )


def tokenizer_path(cfg: Config) -> str:
    return cfg.model.tokenizer or cfg.model.pretrained


def build_actor(cfg: Config, with_lora: bool = True):
    """The actor, with fresh LoRA adapters when ``model.lora.rank > 0``."""
    actor = disable_dropout(load_actor(cfg.model.pretrained, cfg.model.dtype))
    lora = cfg.model.lora
    if with_lora and lora.rank > 0:
        actor = apply_lora(actor, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    return actor


def build_critic(cfg: Config) -> Critic:
    """The critic; its backbone gets LoRA adapters when ``model.lora.critic`` (the value head stays trainable)."""
    critic = disable_dropout(Critic.from_pretrained(cfg.model.critic_pretrained or cfg.model.pretrained, cfg.model.dtype))
    lora = cfg.model.lora
    if lora.rank > 0 and lora.critic:
        critic.backbone = apply_lora(critic.backbone, lora.rank, lora.alpha, lora.dropout, lora.target_modules,
                                     task_type=None)
    return critic


def has_critic(cfg: Config) -> bool:
    """Whether the run builds, trains, pushes and checkpoints a critic: only ``algo.advantage=gae``."""
    return needs_critic(cfg.algo.advantage)


def build_critic_if_needed(cfg: Config) -> Critic | None:
    """The critic for GAE; None for the critic-free estimators."""
    return build_critic(cfg) if has_critic(cfg) else None


def maker_device(cfg: Config) -> torch.device:
    """Where a maker's models run: the first visible GPU when ``maker.num_gpus > 0``, else the CPU.

    Ray sets ``CUDA_VISIBLE_DEVICES`` of an actor to the GPUs it reserved, so ``cuda:0`` is this
    maker's own GPU (or its share of one); a maker with ``num_gpus > 1`` still uses one.
    """
    if cfg.maker.num_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"maker.num_gpus={cfg.maker.num_gpus:g} but this maker process sees no CUDA device "
                          f"(torch {torch.__version__}); set maker.num_gpus=0 for CPU makers")
    return torch.device("cuda", 0)


def build_experience_maker(cfg: Config, actor=None, critic=None, name: str = "maker",
                           device: torch.device | None = None) -> ExperienceMaker:
    """An ``ExperienceMaker`` with every model on ``device`` (default ``maker_device(cfg)``);
    pass ``actor``/``critic`` to share models with a learner (local loop: its device). No critic
    for the critic-free estimators."""
    device = device if device is not None else maker_device(cfg)
    actor = (actor if actor is not None else build_actor(cfg)).to(device)
    critic = (critic if critic is not None else build_critic(cfg)).to(device) if has_critic(cfg) else None
    # With LoRA the reference is the actor with adapters disabled: no second copy of the weights.
    ref = None if cfg.model.lora.rank > 0 else build_actor(cfg, with_lora=False).eval().to(device)
    reward_model = RewardModel.from_pretrained(cfg.model.reward_pretrained, cfg.model.dtype).eval().to(device) \
        if cfg.model.reward_pretrained else None
    reward_fn = load_reward_fn(cfg.model.reward_fn) if reward_model is None else None
    return ExperienceMaker(actor, ref, critic, load_tokenizer(tokenizer_path(cfg)), sampling_params(cfg),
                           advantage_params(cfg), reward_fn=reward_fn, reward_model=reward_model, name=name)

"""Build the run's components from a ``Config``: models and the experience maker.

Shared by the synchronous local loop, the maker actors and the Ray Train loop, so the three
build exactly the same things from the same config.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ray_ppo.config import Config, ConfigError
from ray_ppo.core.algo import needs_critic
from ray_ppo.core.experience import ExperienceMaker
from ray_ppo.core.models import Critic, RewardModel, load_actor, load_reward_fn, load_tokenizer
from ray_ppo.core.models.hf import disable_dropout
from ray_ppo.core.models.lora import apply_lora
from ray_ppo.core.models.tiny import resolve_pretrained


def resolve_config(cfg: Config) -> Config:
    """Turn machine-local names into absolute paths before the config travels to other processes:
    ``tiny`` model names to the built model's directory, a relative ``data.path`` to an absolute one."""
    model = cfg.model.model_copy(update=dict(
        pretrained=resolve_pretrained(cfg.model.pretrained),
        tokenizer=resolve_pretrained(cfg.model.tokenizer),
        critic_pretrained=resolve_pretrained(cfg.model.critic_pretrained),
        reward_pretrained=resolve_pretrained(cfg.model.reward_pretrained),
    ))
    data = cfg.data
    if data.path and "://" not in data.path and Path(data.path).exists():
        data = data.model_copy(update=dict(path=str(Path(data.path).resolve())))
    return cfg.model_copy(update=dict(model=model, data=data))


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
    for the critic-free estimators. The models it builds itself are in ``cfg.maker_dtype``."""
    device = device if device is not None else maker_device(cfg)
    own = cfg if actor is not None else cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": cfg.maker_dtype})})
    actor = (actor if actor is not None else build_actor(own)).to(device)
    critic = (critic if critic is not None else build_critic(own)).to(device) if has_critic(cfg) else None
    # With LoRA the reference is the actor with adapters disabled: no second copy of the weights.
    # Without a KL term (ppo.uses_reference) there is no reference at all.
    reference = cfg.ppo.uses_reference
    ref = build_actor(own, with_lora=False).eval().to(device) if reference and cfg.model.lora.rank == 0 else None
    reward_model = RewardModel.from_pretrained(cfg.model.reward_pretrained, cfg.model.dtype).eval().to(device) \
        if cfg.model.reward_pretrained else None
    reward_fn = load_reward_fn(cfg.model.reward_fn) if reward_model is None else None
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    return ExperienceMaker(actor, ref, critic, tokenizer, cfg, reward_fn=reward_fn,
                           reward_model=reward_model, name=name, engine_logprobs=cfg.maker.sampler_logprobs,
                           episodes=build_episode_runner(cfg, tokenizer), reference=reference)


def build_episode_runner(cfg: Config, tokenizer):
    """The ``EpisodeRunner`` of ``env.cls``; None for single completions."""
    if cfg.env.cls is None:
        return None
    from ray_ppo.core.episodes import EpisodeRunner
    from ray_ppo.env import load_env_class

    return EpisodeRunner(load_env_class(cfg.env.cls), cfg.env, tokenizer, cfg.data.chat_template)

"""Build a run's models from a ``Config``: the actor (with LoRA), the critic, the tokenizer path.

Shared by the synchronous local loop, the maker actors and the Ray Train loop, so the three
build exactly the same models from the same config (``ray_ppo.makers.build`` builds the maker
around them).
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from ray_ppo.algo import needs_critic
from ray_ppo.config import Config
from ray_ppo.models import Critic, load_actor
from ray_ppo.models.hf import disable_dropout
from ray_ppo.models.lora import apply_lora
from ray_ppo.models.packing import enable_packing
from ray_ppo.models.tiny import resolve_pretrained

logger = logging.getLogger(__name__)


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
    return packed(actor, cfg, cfg.model.pretrained)


def build_critic(cfg: Config) -> Critic:
    """The critic; its backbone gets LoRA adapters when ``model.lora.critic`` (the value head stays trainable)."""
    critic = disable_dropout(Critic.from_pretrained(cfg.model.critic_pretrained or cfg.model.pretrained, cfg.model.dtype))
    lora = cfg.model.lora
    if lora.rank > 0 and lora.critic:
        critic.backbone = apply_lora(critic.backbone, lora.rank, lora.alpha, lora.dropout, lora.target_modules,
                                     task_type=None)
    return packed(critic, cfg, cfg.model.critic_pretrained or cfg.model.pretrained)


def packed(model: nn.Module, cfg: Config, name: str) -> nn.Module:
    """``model`` switched to packed passes with ``model.packing`` (``ray_ppo.models.packing``); a
    model that cannot pack stays padded, with one warning that says why."""
    if cfg.model.packing:
        reason = enable_packing(model)
        if reason is not None:
            logger.warning("model.packing: %s runs padded passes: %s", name, reason)
    return model


def has_critic(cfg: Config) -> bool:
    """Whether the run builds, trains, pushes and checkpoints a critic: only ``algo.advantage=gae``."""
    return needs_critic(cfg.algo.advantage)


def build_critic_if_needed(cfg: Config) -> Critic | None:
    """The critic for GAE; None for the critic-free estimators."""
    return build_critic(cfg) if has_critic(cfg) else None

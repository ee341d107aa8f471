"""Build a maker's ``ExperienceMaker`` from a ``Config``: its models on its device, its reward and
its environment. Shared by the synchronous local loop and the maker actors."""

from __future__ import annotations

from pathlib import Path

import torch

from ray_ppo.config import Config, ConfigError
from ray_ppo.config.preflight import maker_bfloat16, warn_slow_bfloat16
from ray_ppo.makers.experience import ExperienceMaker
from ray_ppo.models import RewardModel, load_reward_fn, load_tokenizer
from ray_ppo.models.build import build_actor, build_critic, has_critic, tokenizer_path


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
    if actor is None and (setting := maker_bfloat16(cfg)):
        warn_slow_bfloat16(device.type, setting)
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
    """The ``EpisodeRunner`` of ``env.cls`` (or the ``AgentRunner`` of ``agent.fn``); None for single
    completions."""
    if cfg.agent.fn is not None:
        from ray_ppo.makers.agents import AgentRunner, load_agent_fn

        return AgentRunner(load_agent_fn(cfg.agent.fn), cfg.agent, cfg.env, tokenizer,
                           model_name=Path(cfg.model.pretrained).name or "policy", max_prompt_len=cfg.data.max_prompt_len)
    if cfg.env.cls is None:
        return None
    from ray_ppo.env import load_env_class
    from ray_ppo.makers.episodes import EpisodeRunner

    return EpisodeRunner(load_env_class(cfg.env.cls), cfg.env, tokenizer, cfg.data.chat_template)

"""Hugging Face model factories: actor/reference, critic, reward model, rule rewards, generation."""

from ray_ppo.models.generation import (
    Rollout,
    SamplingParams,
    generate,
    left_pad,
    model_device,
    response_mask,
    stop_token_ids,
)
from ray_ppo.models.hf import (
    Critic,
    RewardFn,
    RewardModel,
    action_log_probs,
    action_logits,
    action_values,
    load_actor,
    load_reward_fn,
    load_tokenizer,
    position_ids_from_mask,
    torch_dtype,
)
from ray_ppo.models.tiny import ensure_tiny_model, resolve_pretrained

__all__ = [
    "Critic", "RewardFn", "RewardModel", "Rollout", "SamplingParams", "action_log_probs", "action_logits",
    "action_values", "ensure_tiny_model", "generate", "left_pad", "load_actor", "load_reward_fn",
    "load_tokenizer", "model_device", "position_ids_from_mask", "resolve_pretrained", "response_mask",
    "stop_token_ids", "torch_dtype",
]

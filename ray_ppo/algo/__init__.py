"""Pure PyTorch PPO components: experience containers, losses, advantages, KL penalties.

Imports torch and the standard library only (no Ray, no transformers), so everything here is
unit-testable in-process.
"""

from ray_ppo.algo.experience import PER_TOKEN_FIELDS, ExperienceBatch, ExperienceItem, PackedItems
from ray_ppo.algo.functional import (
    KL_ESTIMATORS,
    compute_gae,
    compute_gae_reference,
    compute_kl,
    entropy_from_logits,
    explained_variance,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)
from ray_ppo.algo.kl_controller import AdaptiveKLController, FixedKLController, KLController, make_kl_controller

__all__ = [
    "PER_TOKEN_FIELDS",
    "ExperienceBatch",
    "ExperienceItem",
    "PackedItems",
    "KL_ESTIMATORS",
    "compute_gae",
    "compute_gae_reference",
    "compute_kl",
    "entropy_from_logits",
    "explained_variance",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "value_loss",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "make_kl_controller",
]

"""GSPO, CISPO and the sequence-level corrections through the learner on the tiny model: each
trains a step and reports its metrics."""

import math

import pytest
import torch

from ray_ppo.config import Config
from ray_ppo.core.algo import ExperienceBatch
from ray_ppo.core.build import build_actor, build_experience_maker
from ray_ppo.core.learner import PPOLearner, drop_absent
from ray_ppo.core.strategies import LocalStrategy


def config(tiny_path, **overrides) -> Config:
    return Config().with_overrides({"model.pretrained": tiny_path, "algo.advantage": "grpo",
                                    "maker.samples_per_prompt": 4, "maker.batch_size": 2, "maker.max_new_tokens": 6,
                                    "trainer.train_batch_size": 8, "trainer.mini_batch_size": 4,
                                    "ppo.kl_coef": 0.0, **overrides})


@pytest.fixture(scope="module")
def made(tiny_path):
    """(maker, items) of two prompts, four responses each."""
    torch.manual_seed(0)
    maker = build_experience_maker(config(tiny_path))
    items, _ = maker.make_experience([[3, 4, 5], [6, 7]], policy_version=0)
    return maker, items


@pytest.fixture
def stale_batch(made):
    """The items as a stale batch (behaviour log-probs off the learner's)."""
    maker, items = made
    batch = ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)
    noise = 0.3 * torch.randn(batch.action_log_probs.shape, generator=torch.Generator().manual_seed(1))
    batch.action_log_probs = torch.where(batch.action_mask, batch.action_log_probs + noise, 0.0)
    batch.advantages = torch.where(batch.action_mask, torch.linspace(-1.0, 1.0, 8).unsqueeze(1), 0.0)
    return batch


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def changed(model, before) -> bool:
    return any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("overrides, keys", [
    ({"ppo.policy_loss": "gspo", "ppo.eps_clip": 3e-4, "ppo.eps_clip_high": 4e-4,
      "ppo.loss_agg": "seq_mean_token_mean"}, []),
    ({"ppo.policy_loss": "cispo", "ppo.eps_clip_high": 4.0}, []),
    ({"ppo.off_policy": "seq_tis"}, ["seq_capped_frac"]),
    ({"ppo.off_policy": "seq_mask", "ppo.seq_mask_low": 0.5, "ppo.seq_mask_high": 2.0},
     ["seq_masked_frac", "is_capped_frac"]),
    ({"ppo.off_policy": "icepop", "ppo.policy_loss": "gspo"}, ["icepop_masked_frac"]),
])
def test_each_option_trains_a_step(tiny_path, stale_batch, overrides, keys):
    cfg = config(tiny_path, **overrides)
    learner = PPOLearner(build_actor(cfg), None, LocalStrategy(), cfg)
    before = weights(learner.actor)
    metrics = drop_absent(learner.train_step(stale_batch, version=1))
    assert all(key in metrics and 0.0 <= metrics[key] <= 1.0 for key in keys)
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["nonfinite_updates"] == 0
    assert changed(learner.actor, before)

"""Numerical faults: a non-finite loss or gradient skips the update; too many in a row end the run."""

import pytest
import torch

from ray_ppo.algo import ExperienceBatch
from ray_ppo.config import Config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.models.build import build_actor, build_critic
from ray_ppo.train.learner import PPOLearner
from ray_ppo.train.strategies import LocalStrategy


@pytest.fixture
def cfg(tiny_path):
    return Config().with_overrides({"model.pretrained": tiny_path, "trainer.train_batch_size": 8,
                                    "trainer.mini_batch_size": 4, "trainer.max_nonfinite_updates": 3})


@pytest.fixture
def batch(cfg):
    torch.manual_seed(0)
    maker = build_experience_maker(cfg)
    items, _ = maker.make_experience([[3, 4, 5]] * 4 + [[6, 7]] * 4, policy_version=0)
    return ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_nan_loss_skips_update_and_keeps_weights(cfg, batch):
    learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg)
    before_actor, before_critic = weights(learner.actor), weights(learner.critic)
    poisoned = batch.select(list(range(batch.batch_size)))
    poisoned.returns = torch.full_like(poisoned.returns, float("nan"))  # critic loss is nan
    metrics = learner.train_step(poisoned)
    assert metrics["nonfinite_updates"] == 2  # 2 minibatches, critic update skipped each time
    assert all(torch.equal(v, before_critic[k]) for k, v in learner.critic.state_dict().items())
    assert any(not torch.equal(v, before_actor[k]) for k, v in learner.actor.state_dict().items())  # actor trained
    assert learner.critic_sched.last_epoch == 2  # the schedule stays aligned with the update count


def test_nonfinite_gradient_skips_update(cfg, batch):
    learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg)
    head = learner.critic.value_head.weight
    head.register_hook(lambda grad: torch.full_like(grad, float("inf")))  # finite loss, infinite gradient
    before = weights(learner.critic)
    metrics = learner.train_step(batch)
    assert metrics["nonfinite_updates"] == 2
    assert all(torch.equal(v, before[k]) for k, v in learner.critic.state_dict().items())


def test_too_many_nonfinite_updates_in_a_row_end_the_run(cfg, batch):
    learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg)
    poisoned = batch.select(list(range(batch.batch_size)))
    poisoned.advantages = torch.full_like(poisoned.advantages, float("nan"))
    poisoned.returns = torch.full_like(poisoned.returns, float("nan"))
    with pytest.raises(FloatingPointError, match=r"4 optimizer updates in a row.*trainer.max_nonfinite_updates"):
        learner.train_step(poisoned)

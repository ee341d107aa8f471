"""Unit tests of the synchronous local loop (ray_ppo.local) and the PPO learner, on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ray_ppo.algo import ExperienceBatch
from ray_ppo.config import Config, load_config
from ray_ppo.local import run_local
from ray_ppo.makers.experience import ExperienceMaker
from ray_ppo.models import Critic, load_actor, load_tokenizer
from ray_ppo.models.hf import disable_dropout
from ray_ppo.tasks import toy
from ray_ppo.train.learner import PPOLearner, lr_lambda
from ray_ppo.train.strategies import LocalStrategy

ROOT = Path(__file__).parents[2]
STEP_KEYS = {"reward_mean", "kl", "policy_loss", "value_loss", "clipfrac", "approx_kl", "entropy",
             "step", "policy_version", "staleness_mean", "actor_lr", "explained_variance"}

SMALL = {"trainer.total_steps": 3, "trainer.train_batch_size": 8, "trainer.mini_batch_size": 4,
         "maker.batch_size": 8, "maker.max_new_tokens": 6}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# -- the local loop -----------------------------------------------------------------------------


def test_run_local_reports_every_step():
    seen = []
    prompts = toy.make_prompts(12, 4) + ["", None, "   "]  # blank prompts are skipped, not fatal
    history = run_local(Config().with_overrides(SMALL), prompts=prompts, on_metrics=seen.append)
    assert seen == history
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for metrics in history:
        assert STEP_KEYS <= metrics.keys()
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert 0.0 <= metrics["reward_mean"] <= 1.0
        assert 0.0 <= metrics["clipfrac"] <= 1.0
        assert metrics["entropy"] > 0.0
        assert metrics["staleness_mean"] == 0.0  # synchronous: every item trained on at the version that made it
        assert metrics["actor_lr"] == pytest.approx(1e-5)  # constant schedule, the default trainer.actor_lr
        assert 1 <= metrics["response_length"] <= 6


def test_run_local_trains_an_agent_through_its_endpoint():
    """``ray-ppo local`` with agent.fn: the synchronous loop streams each step's groups through the
    endpoint as a maker does (``ray_ppo.tasks.turns.two_turn_agent``, two calls an episode)."""
    cfg = Config().with_overrides({**SMALL, "model.pretrained": "tiny-chat", "data.chat_template": True,
                                   "maker.max_running": 8, "maker.samples_per_prompt": 2, "algo.advantage": "grpo",
                                   "agent.fn": "ray_ppo.tasks.turns:two_turn_agent", "env.max_tokens": 24})
    history = run_local(cfg, prompts=toy.make_prompts(24, 4))
    assert [m["step"] for m in history] == [1, 2, 3]
    assert all(m["env/turns"] == 2.0 and m["env/fault"] == 0.0 for m in history)


def test_first_update_starts_at_ratio_one():
    cfg = Config().with_overrides({**SMALL, "trainer.total_steps": 1, "trainer.mini_batch_size": 8})
    (metrics,) = run_local(cfg)  # one step, one epoch, one minibatch: a single update at the behaviour policy
    assert metrics["clipfrac"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-6


@pytest.mark.timeout(5, method="signal")
@pytest.mark.parametrize("prompts", [[], ["", None, "  "]], ids=["empty", "all-blank"])
def test_no_usable_prompts_is_an_error(prompts):
    with pytest.raises(ValueError):
        run_local(Config().with_overrides({**SMALL, "trainer.total_steps": 1}), prompts=prompts)


def test_the_toy_task_is_learned():
    # configs/tiny.yaml (batch 64, lr 1e-3, kl_coef 0.001, gamma = lam = 1) with 4 PPO epochs instead of 2,
    # so that 40 synchronous steps suffice; with seed 0 the reward goes ~0.09 -> ~0.7 (seed 1: ~0.6)
    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      ["trainer.total_steps=40", "trainer.ppo_epochs=4", "data.path=null", "seed=0"])
    rewards = [m["reward_mean"] for m in run_local(cfg)]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    assert first < 0.15  # an untrained model scores about 1/13
    assert last > first + 0.15, rewards


# -- the learner --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def experience(tiny_path):
    """One merged batch of 8 toy-task samples from the tiny model."""
    tokenizer = load_tokenizer(tiny_path)
    maker = ExperienceMaker(load_actor(tiny_path), load_actor(tiny_path), Critic.from_pretrained(tiny_path),
                            tokenizer, Config().with_overrides({"maker.max_new_tokens": 6, "ppo.kl_coef": 0.01}),
                            reward_fn=toy.reward)
    torch.manual_seed(0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in toy.make_prompts(8, 4)]
    items, stats = maker.make_experience(prompts, policy_version=0)
    assert len(items) == stats.num_samples == 8
    return ExperienceBatch.merge(items, tokenizer.pad_token_id)


def test_a_makers_responses_end_at_the_first_eos_or_pad(tiny_path):
    """The maker's items never hold an end token (EOS or pad) before their last token; the tiny
    model samples both, so some items end with each; the reward reads the response up to there."""
    tokenizer = load_tokenizer(tiny_path)
    maker = ExperienceMaker(load_actor(tiny_path), load_actor(tiny_path), Critic.from_pretrained(tiny_path), tokenizer,
                            Config().with_overrides({"maker.max_new_tokens": 8}), reward_fn=toy.reward)
    ends = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert maker.stop_ids == ends
    torch.manual_seed(0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in toy.make_prompts(64, 4)]
    items, _ = maker.make_experience(prompts, policy_version=0)
    last = [int(item.response_ids[-1]) for item in items]
    assert {tokenizer.eos_token_id, tokenizer.pad_token_id} <= set(last)
    for item in items:
        assert not set(item.response_ids[:-1].tolist()) & set(ends), item.response_ids
    scores = toy.reward(tokenizer.batch_decode([item.prompt_ids for item in items], skip_special_tokens=True),
                        tokenizer.batch_decode([item.response_ids for item in items], skip_special_tokens=True))
    assert [item.reward for item in items] == pytest.approx(scores)


def learner(tiny_path, **trainer) -> PPOLearner:
    """A learner of the 8-item batch; ``trainer`` overrides trainer.* settings. Its schedule spans
    trainer.total_steps x ppo_epochs x (8 / mini_batch_size) updates."""
    defaults = dict(actor_lr=1e-3, critic_lr=1e-3, train_batch_size=8, mini_batch_size=4, ppo_epochs=2, total_steps=1)
    cfg = Config().with_overrides({f"trainer.{key}": value for key, value in {**defaults, **trainer}.items()})
    # the models as the pipelines build them: dropout disabled (build.disable_dropout)
    return PPOLearner(disable_dropout(load_actor(tiny_path)), disable_dropout(Critic.from_pretrained(tiny_path)),
                      LocalStrategy(), cfg, seed=0)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    return {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}


def test_train_step_updates_actor_and_critic(tiny_path, experience):
    ppo = learner(tiny_path)
    actor_before, critic_before = snapshot(ppo.actor), snapshot(ppo.critic)
    metrics = ppo.train_step(experience)
    assert {"policy_loss", "value_loss", "entropy", "clipfrac", "approx_kl", "vf_clipfrac", "actor_grad_norm",
            "critic_grad_norm", "actor_lr", "critic_lr", "explained_variance"} <= metrics.keys()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor_grad_norm"] > 0 and metrics["critic_grad_norm"] > 0
    assert "transformer.h.0.attn.c_attn.weight" in changed(actor_before, ppo.actor)
    assert {"value_head.weight", "value_head.bias"} <= changed(critic_before, ppo.critic)
    assert ppo.actor_sched.last_epoch == ppo.critic_sched.last_epoch == 4  # 2 epochs x 2 minibatches


def test_first_update_of_the_learner_is_at_ratio_one(tiny_path, experience):
    ppo = learner(tiny_path, mini_batch_size=8, ppo_epochs=1, total_steps=1)  # 1 update
    metrics = ppo.train_step(experience)
    assert metrics["clipfrac"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-6


def test_warm_up_scales_the_learning_rate(tiny_path, experience):
    ppo = learner(tiny_path, mini_batch_size=8, ppo_epochs=1, warmup_steps=4, total_steps=8)  # 8 updates
    metrics = ppo.train_step(experience)
    # after 1 update the multiplier is (1 + 1) / 4 = 0.5
    assert metrics["actor_lr"] == pytest.approx(5e-4)
    assert metrics["critic_lr"] == pytest.approx(5e-4)


def test_learner_state_dict_round_trip(tiny_path, experience):
    ppo = learner(tiny_path)
    ppo.train_step(experience)
    other = learner(tiny_path)
    other.load_state(ppo.full_state_dict())
    assert other.actor_sched.last_epoch == 4
    assert torch.equal(torch.randperm(8, generator=other.generator), torch.randperm(8, generator=ppo.generator))


@pytest.mark.parametrize("schedule, n, expected", [
    # warm-up 2 updates of 10: (n + 1) / 2 while n < 2, whatever the schedule
    ("constant", 0, 0.5), ("linear", 0, 0.5), ("cosine", 1, 1.0),
    ("constant", 2, 1.0), ("constant", 9, 1.0), ("constant", 50, 1.0),
    # linear: 1 - (n - 2) / 8
    ("linear", 2, 1.0), ("linear", 4, 0.75), ("linear", 6, 0.5), ("linear", 10, 0.0), ("linear", 20, 0.0),
    # cosine: (1 + cos(pi (n - 2) / 8)) / 2
    ("cosine", 2, 1.0), ("cosine", 4, (1 + math.sqrt(0.5)) / 2), ("cosine", 6, 0.5), ("cosine", 10, 0.0),
])
def test_lr_lambda(schedule, n, expected):
    assert lr_lambda(schedule, warmup_steps=2, total_updates=10)(n) == pytest.approx(expected, abs=1e-12)


def test_lr_lambda_without_warm_up():
    assert lr_lambda("linear", 0, 4)(0) == 1.0
    assert lr_lambda("linear", 0, 4)(1) == 0.75
    assert lr_lambda("cosine", 0, 1)(0) == 1.0

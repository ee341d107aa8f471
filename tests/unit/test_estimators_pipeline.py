"""The estimators and the off-policy correction wired through the maker, the learner and the
synchronous loop, on the tiny model: groups, no critic, importance-weight statistics."""

from __future__ import annotations

import math

import pytest
import torch

from ray_ppo.algo import ExperienceBatch
from ray_ppo.config import Config
from ray_ppo.local import run_local
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.tasks import sum_mod10, toy
from ray_ppo.train.learner import PPOLearner
from ray_ppo.train.strategies import LocalStrategy

SMALL = {"trainer.total_steps": 2, "trainer.train_batch_size": 8, "trainer.mini_batch_size": 4,
         "maker.batch_size": 4, "maker.max_new_tokens": 4}


def config(**overrides) -> Config:
    return Config().with_overrides({**SMALL, **overrides})


def made(cfg: Config, prompts: list[str]):
    maker = build_experience_maker(cfg, name="t")
    ids = [maker.tokenizer(p)["input_ids"] for p in prompts]
    items, _ = maker.make_experience(ids, policy_version=0)
    return maker, items


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_maker_lays_out_groups_and_builds_no_critic(estimator):
    torch.manual_seed(0)
    cfg = config(**{"algo.advantage": estimator, "maker.samples_per_prompt": 4})
    maker, items = made(cfg, ["1 2", "3 4"])
    assert maker.critic is None and len(items) == 8
    for g in range(2):
        group = items[4 * g:4 * g + 4]
        assert all(torch.equal(it.prompt_ids, group[0].prompt_ids) for it in group)
        per_response = [float(it.advantages[0]) for it in group]
        # every token of a response shares its advantage; a group's advantages are centred
        assert all(torch.all(it.advantages == it.advantages[0]) for it in group)
        assert abs(sum(per_response)) < 1e-4
        assert all(torch.all(it.values == 0) for it in group)


def test_reinforce_pp_items_carry_discounted_returns():
    cfg = config(**{"algo.advantage": "reinforce_pp", "ppo.kl_coef": 0.1})
    _, items = made(cfg, ["5 5"])
    it = items[0]
    # gamma 1: the first token's return is the sum of the per-token rewards (score - KL penalties)
    assert float(it.advantages[0]) == pytest.approx(float(it.rewards.sum()), abs=1e-5)
    assert torch.equal(it.advantages, it.returns)


def test_kl_in_loss_leaves_the_rewards_unpenalised():
    cfg = config(**{"ppo.kl_in": "loss", "ppo.kl_coef": 1.0})
    _, items = made(cfg, ["1 2 3"])
    it = items[0]
    assert torch.all(it.rewards[:-1] == 0) and float(it.rewards[-1]) == pytest.approx(it.reward)


@pytest.mark.parametrize("kl_coef, kl_target, uses", [(0.0, None, False), (0.01, None, True), (0.0, 6.0, True)])
def test_a_reference_is_used_only_where_a_kl_term_reads_it(kl_coef, kl_target, uses):
    assert config(**{"ppo.kl_coef": kl_coef, "ppo.kl_target": kl_target}).ppo.uses_reference is uses


def test_without_a_kl_term_the_maker_loads_no_reference_and_reports_no_kl(monkeypatch):
    from ray_ppo.algo.metrics import experience_metrics
    from ray_ppo.makers import experience

    cfg = config(**{"ppo.kl_coef": 0.0, "ppo.kl_in": "loss", "algo.advantage": "grpo", "maker.samples_per_prompt": 2})
    monkeypatch.setattr(experience.ExperienceMaker, "_ref_log_probs", lambda *a: pytest.fail("no reference pass"))
    torch.manual_seed(0)
    maker, items = made(cfg, ["1 2", "3 4", "5 6", "7 8"])
    assert maker.ref is None and not maker.reference
    assert all(torch.equal(it.ref_log_probs, it.action_log_probs) for it in items)
    metrics = experience_metrics(items, version=0, reference=cfg.ppo.uses_reference)
    assert "kl" not in metrics and "reward_mean" in metrics
    learned = PPOLearner(maker.actor, maker.critic, LocalStrategy(), cfg).train_step(
        ExperienceBatch.merge(items, maker.tokenizer.pad_token_id), version=0)
    assert "kl_loss" not in learned and math.isfinite(learned["policy_loss"])
    with_reference = config(**{"ppo.kl_coef": 0.01})
    assert build_experience_maker(with_reference, name="t").ref is not None


def _batch_and_learner(cfg: Config):
    torch.manual_seed(0)
    maker, items = made(cfg, ["1 2", "3 4", "5 6", "7 8"])
    learner = PPOLearner(maker.actor, maker.critic, LocalStrategy(), cfg)
    return ExperienceBatch.merge(items, maker.tokenizer.pad_token_id), learner


def test_critic_free_learner_trains_and_saves_no_critic():
    cfg = config(**{"algo.advantage": "grpo", "maker.samples_per_prompt": 2})
    batch, learner = _batch_and_learner(cfg)
    metrics = learner.train_step(batch, version=0)
    assert "value_loss" not in metrics and "critic_lr" not in metrics
    assert math.isfinite(metrics["policy_loss"])
    assert set(learner.full_state_dict()) == {"actor", "actor_sched", "generator"}


def test_off_policy_weights_are_one_on_fresh_experience_and_move_with_staleness():
    cfg = config(**{"ppo.off_policy": "tis", "ppo.max_staleness": 2, "trainer.actor_lr": 0.01})
    batch, learner = _batch_and_learner(cfg)
    fresh = learner.train_step(batch, version=0)  # this step moves the policy: the batch becomes stale
    # the trainer's own policy generated the batch: pi_old == mu, weights 1, KL 0
    assert fresh["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fresh["is_capped_frac"] == 0.0 and fresh["behaviour_kl"] == pytest.approx(0.0, abs=1e-5)
    assert math.isnan(fresh["behaviour_kl_stale_1"])  # no item of staleness 1 (the loops drop the key)
    stale = learner.train_step(batch, version=1)
    assert stale["behaviour_kl"] > 1e-4 and stale["behaviour_kl_stale_1"] == pytest.approx(stale["behaviour_kl"])
    assert stale["is_weight_max"] > 1.0


@pytest.mark.parametrize("off_policy", ["tis", "decoupled"])
def test_a_batch_sampled_by_the_learners_own_actor_needs_no_proximal_forward_pass(off_policy, monkeypatch):
    cfg = config(**{"ppo.off_policy": off_policy})
    batch, learner = _batch_and_learner(cfg)
    reference_batch, reference = _batch_and_learner(cfg)  # the same seed: the same weights and batch
    expected = reference.train_step(reference_batch, version=0)  # with the forward pass: weights ~1

    def no_forward(_batch):
        raise AssertionError("the synchronous loop's batch needs no proximal forward pass")
    monkeypatch.setattr(learner, "_log_probs", no_forward)
    got = learner.train_step(batch, version=0, behaviour_is_policy=True)
    assert got["is_weight_mean"] == 1.0 and got["is_weight_max"] == 1.0 and got["behaviour_kl"] == 0.0
    assert got["policy_loss"] == pytest.approx(expected["policy_loss"], abs=1e-5)
    for p, q in zip(learner.actor.parameters(), reference.actor.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)  # the same update


@pytest.mark.parametrize("overrides", [
    {"algo.advantage": "grpo", "maker.samples_per_prompt": 2, "algo.group_norm_std": False,
     "ppo.loss_agg": "seq_mean_token_sum", "ppo.off_policy": "none"},
    {"algo.advantage": "rloo", "maker.samples_per_prompt": 4, "ppo.kl_in": "loss", "ppo.kl_estimator": "k3"},
    {"algo.advantage": "reinforce_pp", "ppo.off_policy": "tis", "ppo.eps_clip_high": 0.28},
], ids=["dr_grpo", "rloo_kl_loss", "reinforce_pp_tis"])
def test_run_local_with_each_estimator(overrides):
    cfg = config(**overrides, **{"model.reward_fn": "ray_ppo.tasks.sum_mod10:reward"})
    history = run_local(cfg, prompts=sum_mod10.make_prompts(16))
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        assert all(math.isfinite(v) for v in m.values()), m
        assert "value_loss" not in m
        assert ("kl_loss" in m) == (overrides.get("ppo.kl_in") == "loss")
        assert ("is_weight_mean" in m) == (overrides.get("ppo.off_policy") != "none")


def test_sum_mod10_reward():
    # (3 + 8) % 10 = 1: two of the first four tokens are right; tokens after the fourth do not count
    assert sum_mod10.reward(["3 8", "0 0", "1 2 3"], ["1 5 1 2 1 1", "0 0 0 0", "3"]) == [0.5, 1.0, 0.0]
    prompts = sum_mod10.make_prompts(200, seed=1)
    assert len(set(prompts)) > 80 and all(sum_mod10.answer(p) is not None for p in prompts)
    assert toy.reward(["1 2"], ["2 2"]) == [0.25]

"""GSPO, CISPO, the sequence-level corrections and DAPO's overlong handling through the maker and
the learner on the tiny model: each trains a step and reports its metrics, truncation is recorded
and travels with an item, the overlong penalty shapes the reward the advantages see, and overlong
filtering keeps truncated responses out of the policy loss."""

import math

import pytest
import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem, overlong_penalty
from ray_ppo.algo.experience import unpack
from ray_ppo.config import Config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.models.build import build_actor
from ray_ppo.train.learner import PPOLearner, drop_absent
from ray_ppo.train.strategies import LocalStrategy
from ray_ppo.wire.packed import PackedItems


def config(tiny_path, **overrides) -> Config:
    return Config().with_overrides({"model.pretrained": tiny_path, "algo.advantage": "grpo",
                                    "maker.samples_per_prompt": 4, "maker.batch_size": 2, "maker.max_new_tokens": 6,
                                    "trainer.train_batch_size": 8, "trainer.mini_batch_size": 4,
                                    "ppo.kl_coef": 0.0, **overrides})


@pytest.fixture(scope="module")
def made(tiny_path):
    """(maker, items) of two prompts, four responses each, with a soft overlong penalty."""
    torch.manual_seed(0)
    maker = build_experience_maker(config(tiny_path, **{"algo.overlong_buffer": 2, "algo.overlong_penalty": 0.5}))
    items, _ = maker.make_experience([[3, 4, 5], [6, 7]], policy_version=0)
    return maker, items


@pytest.fixture
def stale_batch(made):
    """The items as a stale batch (behaviour log-probs off the learner's), half of them truncated."""
    maker, items = made
    batch = ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)
    noise = 0.3 * torch.randn(batch.action_log_probs.shape, generator=torch.Generator().manual_seed(1))
    batch.action_log_probs = torch.where(batch.action_mask, batch.action_log_probs + noise, 0.0)
    batch.advantages = torch.where(batch.action_mask, torch.linspace(-1.0, 1.0, 8).unsqueeze(1), 0.0)
    batch.truncated = torch.tensor([True, False] * 4)
    return batch


def test_the_maker_records_truncation_and_shapes_the_score_near_the_limit(made):
    maker, items = made
    assert any(item.truncated for item in items)  # the tiny model rarely ends within 6 tokens
    for item in items:
        assert item.truncated == (int(item.response_ids[-1]) not in maker.stop_ids)
        # the score stays the item's reward; the penalised score sits at the last token (no KL: kl_coef 0)
        penalty = overlong_penalty(torch.tensor([item.response_length]), 6, 2, 0.5).item()
        assert item.rewards[-1].item() == pytest.approx(item.reward + penalty)
        assert penalty == (0.0 if item.response_length <= 4 else -0.5 * (item.response_length - 4) / 2)


def test_truncation_survives_merge_split_and_the_wire():
    items = [ExperienceItem.filled(torch.tensor([1, 2]), torch.tensor([3, 4, 5]), reward=0.0, policy_version=0,
                                   truncated=flag) for flag in (True, False)]
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    assert batch.truncated.tolist() == [True, False]
    assert batch.select([1, 0]).truncated.tolist() == [False, True]
    for back in (batch.split(), unpack(PackedItems.pack(items))):
        assert [it.truncated for it in back] == [True, False]
    assert PackedItems.pack(items[1:]).truncated is None  # nothing to send when no item is truncated


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
    ({"algo.overlong_buffer": 2, "algo.overlong_filter": True},
     ["overlong_penalized_frac", "overlong_penalty_mean", "overlong_filtered_frac"]),
])
def test_each_option_trains_a_step(tiny_path, stale_batch, overrides, keys):
    cfg = config(tiny_path, **overrides)
    learner = PPOLearner(build_actor(cfg), None, LocalStrategy(), cfg)
    before = weights(learner.actor)
    metrics = drop_absent(learner.train_step(stale_batch, version=1))
    assert all(key in metrics and 0.0 <= metrics[key] <= 1.0 for key in keys if key != "overlong_penalty_mean")
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["nonfinite_updates"] == 0
    assert changed(learner.actor, before)
    if "algo.overlong_filter" in overrides:
        assert metrics["overlong_filtered_frac"] == 0.5
        lengths = stale_batch.action_mask.sum(dim=1)
        assert metrics["overlong_penalty_mean"] == pytest.approx(overlong_penalty(lengths, 6, 2, 1.0).mean().item())


def test_overlong_filtering_keeps_truncated_responses_out_of_the_policy_loss(tiny_path, stale_batch):
    stale_batch.truncated = torch.ones(8, dtype=torch.bool)
    for overlong_filter in (True, False):
        cfg = config(tiny_path, **{"algo.overlong_filter": overlong_filter})
        learner = PPOLearner(build_actor(cfg), None, LocalStrategy(), cfg)
        before = weights(learner.actor)
        metrics = learner.train_step(stale_batch, version=1)
        # every response filtered: no token to learn from, a loss of 0, and the actor stays as it was
        assert (metrics["policy_loss"] == 0.0) == overlong_filter
        assert changed(learner.actor, before) != overlong_filter

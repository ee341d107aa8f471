"""Training on multi-turn episodes, by hand: the environment's tokens between turns are in the
context but carry no loss, no KL and no value target, and each turn's reward sits at its last token.

Two hand-built episodes of one group, response width 5:

    A: policy a0 a1 | env e0 e1 | policy a4      mask [1, 1, 0, 0, 1]
       turn rewards: 0.5 (turn 1, at a1), 1.0 (turn 2, at a4)
    B: policy b0 b1 b2 (one turn), then padding mask [1, 1, 1, 0, 0], reward 0
"""

import pytest
import torch

from ray_ppo.algo import (
    ExperienceBatch,
    ExperienceItem,
    compute_advantages,
    compute_gae,
    compute_gae_reference,
    discounted_returns,
    kl_penalized_rewards,
    policy_loss,
    value_loss,
)
from ray_ppo.algo.experience import unpack
from ray_ppo.algo.metrics import experience_metrics
from ray_ppo.wire.packed import PackedItems

MASK = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
GARBAGE = 9.0  # what sits at the environment's tokens and the padding: must change nothing
KL = torch.tensor([[0.2, 0.1, GARBAGE, GARBAGE, 0.3], [0.0, 0.0, 0.0, GARBAGE, GARBAGE]])
TOKEN_SCORES = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
SCORE = TOKEN_SCORES.sum(dim=1)  # 1.5, 0.0
VALUES = torch.tensor([[0.1, 0.2, GARBAGE, GARBAGE, 0.4], [0.0, 0.0, 0.0, GARBAGE, GARBAGE]])
KL_COEF = 0.1


def test_turn_rewards_sit_at_each_turn_s_last_token_with_the_kl_penalty_on_actions_only():
    rewards = kl_penalized_rewards(SCORE, KL, MASK, KL_COEF, TOKEN_SCORES)
    # A: -0.1*0.2, -0.1*0.1 + 0.5, env 0, env 0, -0.1*0.3 + 1.0
    assert rewards[0].tolist() == pytest.approx([-0.02, 0.49, 0.0, 0.0, 0.97])
    assert rewards[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0])


def test_discounted_returns_skip_the_environment_s_tokens():
    rewards = kl_penalized_rewards(SCORE, KL, MASK, KL_COEF, TOKEN_SCORES)
    returns = discounted_returns(rewards, MASK, gamma=0.5)
    # G(a4) = 0.97; G(a1) = 0.49 + 0.5 * 0.97 = 0.975; G(a0) = -0.02 + 0.5 * 0.975 = 0.4675
    assert returns[0].tolist() == pytest.approx([0.4675, 0.975, 0.0, 0.0, 0.97])


def test_gae_steps_from_one_turn_to_the_next_over_the_environment_s_tokens():
    rewards = kl_penalized_rewards(SCORE, KL, MASK, KL_COEF, TOKEN_SCORES)
    advantages, returns = compute_gae(rewards, VALUES, MASK, gamma=1.0, lam=0.5)
    # delta(a4) = 0.97 - 0.4 = 0.57                      A(a4) = 0.57
    # delta(a1) = 0.49 + V(a4) - V(a1) = 0.49 + 0.4 - 0.2 = 0.69, A(a1) = 0.69 + 0.5 * 0.57 = 0.975
    # delta(a0) = -0.02 + 0.2 - 0.1 = 0.08,              A(a0) = 0.08 + 0.5 * 0.975 = 0.5675
    assert advantages[0].tolist() == pytest.approx([0.5675, 0.975, 0.0, 0.0, 0.57])
    assert returns[0].tolist() == pytest.approx([0.6675, 1.175, 0.0, 0.0, 0.97])
    reference = compute_gae_reference(rewards, VALUES, MASK, gamma=1.0, lam=0.5)
    assert torch.allclose(advantages, reference[0]) and torch.allclose(returns, reference[1])


def test_gae_with_holes_matches_the_reference_on_random_masks():
    torch.manual_seed(0)
    mask = torch.rand(6, 12) < 0.6
    mask[:, 0] = True
    rewards, values = torch.randn(6, 12), torch.randn(6, 12)
    fast, reference = compute_gae(rewards, values, mask, 0.9, 0.8), compute_gae_reference(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(fast[0], reference[0], atol=1e-6) and torch.allclose(fast[1], reference[1], atol=1e-6)


def test_group_advantages_count_the_episode_s_total_reward_and_reach_its_actions_only():
    for estimator in ("grpo", "rloo"):
        rewards, advantages, _ = compute_advantages(estimator, SCORE, KL, torch.zeros_like(KL), MASK, kl_coef=KL_COEF,
                                                    group_size=2, token_scores=TOKEN_SCORES)
        # totals: A = -0.02 + 0.49 + 0.97 = 1.44, B = 0; GRPO: +-(0.72 / std([1.44, 0]) = 0.7071);
        # RLOO: A = 1.44 - 0 = 1.44, B = 0 - 1.44
        a = 0.72 / torch.tensor([1.44, 0.0]).std().item() if estimator == "grpo" else 1.44
        assert advantages[0].tolist() == pytest.approx([a, a, 0.0, 0.0, a], abs=1e-5)
        assert advantages[1].tolist() == pytest.approx([-a, -a, -a, 0.0, 0.0], abs=1e-5)


def test_the_loss_ignores_whatever_sits_at_the_environment_s_tokens():
    advantages = torch.tensor([[1.0, 1.0, GARBAGE, GARBAGE, 1.0]])
    old = torch.zeros(1, 5)
    new = torch.tensor([[0.1, 0.1, 50.0, -50.0, 0.1]])  # ratio e^0.1 = 1.105 on actions, wild on env tokens
    loss, stats = policy_loss(new, old, advantages, MASK[:1], eps_clip=0.2)
    assert loss.item() == pytest.approx(-torch.exp(torch.tensor(0.1)).item())  # -A * ratio, mean of 3 actions
    assert stats["clipfrac"].item() == 0.0
    v_loss, _ = value_loss(torch.tensor([[1.0, 1.0, GARBAGE, GARBAGE, 1.0]]), old, torch.zeros(1, 5), MASK[:1])
    assert v_loss.item() == pytest.approx(0.5)  # 0.5 * mean(1^2) over the 3 actions


def _episode_item(uid: str, actions: list[int] | None, reward: float) -> ExperienceItem:
    n = len(actions) if actions is not None else 3
    item = ExperienceItem.filled(torch.tensor([5, 6]), torch.arange(3, 3 + n),
                                 per_token=lambda name: torch.arange(n, dtype=torch.float32) + 1, reward=reward,
                                 policy_version=2, uid=uid)
    if actions is not None:
        item.action_mask = torch.tensor(actions, dtype=torch.bool)
        item.episode = {"turns": 2.0, "fault": 0.0}
    return item


def test_action_masks_survive_merge_split_and_the_wire():
    items = [_episode_item("a", [1, 1, 0, 0, 1], 1.5), _episode_item("b", None, 0.0), _episode_item("c", [1, 0, 1], 0.5)]
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    assert batch.attention_mask[:, batch.prompt_len:].sum(dim=1).tolist() == [5, 3, 3]  # every token is attended
    assert batch.action_mask.sum(dim=1).tolist() == [3, 3, 2]  # only the policy's are actions
    for back in (batch.split(), unpack(PackedItems.pack(items))):
        assert [None if it.action_mask is None else it.action_mask.tolist() for it in back] == \
            [[True, True, False, False, True], None, [True, False, True]]
        assert [it.response_ids.tolist() for it in back] == [it.response_ids.tolist() for it in items]
    assert unpack(PackedItems.pack(items))[0].episode == {"turns": 2.0, "fault": 0.0}
    assert PackedItems.pack([items[1]]).action_mask is None  # single completions pay nothing


def test_step_metrics_count_actions_and_average_the_episodes_counts():
    items = [_episode_item("a", [1, 1, 0, 0, 1], 1.5), _episode_item("c", [1, 0, 1], 0.5)]
    items[1].episode = {"turns": 1.0, "fault": 1.0, "tool_calls": 2.0}
    metrics = experience_metrics(items, version=2)
    assert metrics["response_length"] == 2.5  # (3 + 2) policy tokens
    assert metrics["env/turns"] == 1.5 and metrics["env/fault"] == 0.5 and metrics["env/tool_calls"] == 1.0
    assert metrics["fault_count"] == 1.0
    assert metrics["kl"] == 0.0  # the filled log-probs equal their reference's


def test_an_item_without_a_policy_token_is_refused():
    item = _episode_item("x", [0, 0, 0], 0.0)
    with pytest.raises(ValueError, match="at least one token the policy generated"):
        ExperienceBatch.merge([item], pad_token_id=0)

"""Critic-free estimators, off-policy weights and loss shapes against hand-worked numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from ray_ppo.algo import (
    aggregate_loss,
    behaviour_kl,
    broadcast_to_tokens,
    decoupled_weights,
    discounted_returns,
    grpo_advantages,
    kl_by_staleness,
    needs_critic,
    policy_loss,
    raw_weights,
    reinforce_pp_advantages,
    rloo_advantages,
    tis_weights,
    weight_stats,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def lp(*probs):
    return torch.log(t(*probs))


class TestGRPO:
    def test_hand_worked_group_of_three(self):
        # scores (1, 0, 0.5): mean 0.5, deviations (0.5, -0.5, 0),
        # unbiased std = sqrt((0.25 + 0.25 + 0) / 2) = 0.5 -> (1, -1, 0) up to eps = 1e-6
        assert_close(grpo_advantages(t(1.0, 0.0, 0.5), 3), t(1.0, -1.0, 0.0), atol=1e-5, rtol=0)

    def test_dr_grpo_drops_the_std(self):
        # Dr. GRPO: r - mean only -> (0.5, -0.5, 0)
        assert_close(grpo_advantages(t(1.0, 0.0, 0.5), 3, norm_by_std=False), t(0.5, -0.5, 0.0))

    def test_groups_are_normalised_separately(self):
        # groups of 2: (1, 0) -> mean 0.5, std sqrt(0.5) = 0.7071 -> +-0.7071; (3, 3) -> 0, 0
        out = grpo_advantages(t(1.0, 0.0, 3.0, 3.0), 2)
        assert_close(out, t(0.70711, -0.70711, 0.0, 0.0), atol=1e-4, rtol=0)

    def test_all_equal_rewards_give_zero_not_nan(self):
        # std 0: 0 / (0 + eps) = 0
        out = grpo_advantages(t(1.0, 1.0, 1.0), 3)
        assert torch.all(out == 0) and not torch.isnan(out).any()

    def test_group_of_one_is_the_score(self):
        # no baseline for a group of one (veRL): mean 0, std 1 -> the scores themselves, no nan
        assert_close(grpo_advantages(t(1.0, 0.0, 0.5), 1), t(1.0, 0.0, 0.5))
        assert_close(grpo_advantages(t(1.0, 0.0, 0.5), 1, norm_by_std=False), t(1.0, 0.0, 0.5))

    def test_partial_group_is_refused(self):
        with pytest.raises(ValueError, match="groups of 2"):
            grpo_advantages(t(1.0, 0.0, 0.5), 2)


class TestRLOO:
    def test_hand_worked_group_of_three(self):
        # scores (1, 0, 0.5), sum 1.5: leave-one-out baselines (0 + 0.5) / 2 = 0.25, (1 + 0.5) / 2 = 0.75,
        # (1 + 0) / 2 = 0.5 -> advantages (0.75, -0.75, 0) = 3/2 * (r - 0.5)
        assert_close(rloo_advantages(t(1.0, 0.0, 0.5), 3), t(0.75, -0.75, 0.0))

    def test_all_equal_and_group_of_one(self):
        assert torch.all(rloo_advantages(t(2.0, 2.0, 2.0), 3) == 0)
        # a group of one: baseline 0 -> the score itself
        assert_close(rloo_advantages(t(1.0, 0.0, 0.5), 1), t(1.0, 0.0, 0.5))


class TestReinforcePP:
    def test_discounted_returns_with_padding(self):
        rewards = torch.tensor([[-0.1, -0.1, 0.9], [-0.1, 1.0, 7.0]])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        # gamma 1: row 0 -> (0.7, 0.8, 0.9); row 1 -> (0.9, 1.0, 0) (the padded 7 is ignored)
        assert_close(discounted_returns(rewards, mask, 1.0), torch.tensor([[0.7, 0.8, 0.9], [0.9, 1.0, 0.0]]))
        # gamma 0.5: row 0 -> G_2 = 0.9, G_1 = -0.1 + 0.45 = 0.35, G_0 = -0.1 + 0.175 = 0.075
        assert_close(discounted_returns(rewards[:1], mask[:1], 0.5), torch.tensor([[0.075, 0.35, 0.9]]))

    def test_batch_normalised(self):
        rewards, mask = torch.tensor([[-0.1, -0.1, 0.9]]), torch.ones(1, 3, dtype=torch.bool)
        # returns (0.7, 0.8, 0.9): mean 0.8, population var 0.02 / 3 -> (-1.224745, 0, 1.224745)
        assert_close(reinforce_pp_advantages(rewards, mask, 1.0), torch.tensor([[-1.224745, 0.0, 1.224745]]),
                     atol=1e-4, rtol=0)

    def test_equal_returns_give_zero_not_nan(self):
        rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
        mask = torch.tensor([[0, 1], [0, 1], [0, 1]]).flip(1)  # one valid token per row, all returns 0
        out = reinforce_pp_advantages(rewards, mask, 1.0)
        assert not torch.isnan(out).any() and torch.all(out == 0)


def test_broadcast_and_needs_critic():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(broadcast_to_tokens(t(2.0, -1.0), mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    assert needs_critic("gae") and not any(needs_critic(n) for n in ("grpo", "rloo", "reinforce_pp"))
    with pytest.raises(ValueError, match="valid names"):
        needs_critic("ppo")


class TestOffPolicyWeights:
    # behaviour mu = (0.5, 0.2, 0.4), trainer's pi_old = (0.5, 0.6, 0.1): raw weights (1, 3, 0.25)
    behaviour, old = lp(0.5, 0.2, 0.4), lp(0.5, 0.6, 0.1)

    def test_tis_truncates_at_the_cap(self):
        assert_close(raw_weights(self.old, self.behaviour), t(1.0, 3.0, 0.25))
        # cap 2: (1, 2, 0.25)
        assert_close(tis_weights(self.old, self.behaviour, 2.0), t(1.0, 2.0, 0.25))

    def test_decoupled_drops_above_the_cap(self):
        # cap 2: the token with weight 3 is dropped -> (1, 0, 0.25); cap 5 keeps it
        assert_close(decoupled_weights(self.old, self.behaviour, 2.0), t(1.0, 0.0, 0.25))
        assert_close(decoupled_weights(self.old, self.behaviour, 5.0), t(1.0, 3.0, 0.25))

    def test_weight_stats(self):
        stats = weight_stats(raw_weights(self.old, self.behaviour), 2.0, torch.ones(3, dtype=torch.bool))
        # mean (1 + 3 + 0.25) / 3 = 1.416667, max 3, one of three tokens above the cap
        assert stats["is_weight_mean"] == pytest.approx(4.25 / 3)
        assert stats["is_weight_max"] == pytest.approx(3.0)
        assert stats["is_capped_frac"] == pytest.approx(1 / 3)

    def test_behaviour_kl_k3(self):
        # r = pi_old / mu = (1, 3, 0.25); k3 = r - 1 - ln r = (0, 2 - ln 3, -0.75 + ln 4) = (0, 0.901388, 0.636294)
        assert_close(behaviour_kl(self.old, self.behaviour), t(0.0, 2 - math.log(3), -0.75 + math.log(4)))

    def test_kl_by_staleness(self):
        kl = torch.tensor([[0.2, 0.4], [1.0, 9.0], [3.0, 0.0]])
        mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
        staleness = torch.tensor([0, 2, 2])
        # staleness 0: (0.2 + 0.4) / 2 = 0.3; staleness 1: none -> nan; staleness 2: (1 + 3 + 0) / 3 = 4/3
        out = kl_by_staleness(kl, mask, staleness, 2)
        assert out[0] == pytest.approx(0.3) and math.isnan(out[1]) and out[2] == pytest.approx(4 / 3)

    def test_cap_below_one_is_refused(self):
        with pytest.raises(ValueError, match=">= 1"):
            tis_weights(self.old, self.behaviour, 0.5)


class TestPolicyLossShapes:
    mask = torch.ones(3, dtype=torch.bool)

    def test_decoupled_loss_hand_worked(self):
        # proximal pi_prox = (0.5, 0.6, 0.1), current pi = (0.55, 0.6, 0.15): ratio pi / pi_prox = (1.1, 1, 1.5)
        # advantages (1, -1, 1), eps 0.2: clipped ratio (1.1, 1, 1.2)
        # -A * ratio = (-1.1, 1, -1.5), -A * clipped = (-1.1, 1, -1.2), max = (-1.1, 1, -1.2)
        # decoupled weights (cap 2) (1, 0, 0.25) -> (-1.1, 0, -0.3), token mean -1.4 / 3
        prox, new, adv = lp(0.5, 0.6, 0.1), lp(0.55, 0.6, 0.15), t(1.0, -1.0, 1.0)
        w = decoupled_weights(prox, lp(0.5, 0.2, 0.4), 2.0)
        loss, stats = policy_loss(new, prox, adv, self.mask, 0.2, is_weights=w)
        assert loss.item() == pytest.approx(-1.4 / 3, abs=1e-6)
        assert stats["clipfrac"].item() == pytest.approx(1 / 3)  # only the 1.5 ratio was clipped
        # TIS weights (1, 2, 0.25) -> (-1.1, 2, -0.3), mean 0.6 / 3 = 0.2
        loss, _ = policy_loss(new, prox, adv, self.mask, 0.2, is_weights=tis_weights(prox, lp(0.5, 0.2, 0.4), 2.0))
        assert loss.item() == pytest.approx(0.2, abs=1e-6)

    def test_weights_of_one_leave_the_loss_unchanged(self):
        new, old, adv = lp(0.55, 0.6, 0.15), lp(0.5, 0.6, 0.1), t(1.0, -1.0, 1.0)
        plain, _ = policy_loss(new, old, adv, self.mask, 0.2)
        weighted, _ = policy_loss(new, old, adv, self.mask, 0.2, is_weights=torch.ones(3))
        assert_close(plain, weighted)

    def test_clip_higher(self):
        # ratio 1.25 with a positive advantage: symmetric eps 0.2 clips it to 1.2 -> loss -1.2;
        # eps_clip_high 0.28 lets it through -> -1.25. The low side still clips at 0.8: ratio 0.7 and A = -1
        # -> max(0.7, 0.8) = 0.8.
        new, old = lp(0.625, 0.35), lp(0.5, 0.5)
        adv, mask = t(1.0, -1.0), torch.ones(2, dtype=torch.bool)
        sym, _ = policy_loss(new[:1], old[:1], adv[:1], mask[:1], 0.2)
        high, _ = policy_loss(new[:1], old[:1], adv[:1], mask[:1], 0.2, eps_clip_high=0.28)
        low, _ = policy_loss(new[1:], old[1:], adv[1:], mask[1:], 0.2, eps_clip_high=0.28)
        assert sym.item() == pytest.approx(-1.2, abs=1e-6)
        assert high.item() == pytest.approx(-1.25, abs=1e-6)
        assert low.item() == pytest.approx(0.8, abs=1e-6)

    def test_gradient_of_a_dropped_token_is_zero(self):
        new = lp(0.55, 0.6, 0.15).requires_grad_()
        w = t(1.0, 0.0, 0.25)
        loss, _ = policy_loss(new, lp(0.5, 0.6, 0.1), t(1.0, -1.0, 1.0), self.mask, 0.2, is_weights=w)
        loss.backward()
        assert new.grad[1] == 0 and new.grad[0] != 0


class TestLossAggregation:
    loss = torch.tensor([[1.0, 2.0, 50.0], [3.0, 60.0, 70.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def test_hand_worked(self):
        # token_mean: (1 + 2 + 3) / 3 = 2 (today's behaviour)
        assert aggregate_loss(self.loss, self.mask, "token_mean").item() == pytest.approx(2.0)
        # seq_mean_token_sum: (3 + 3) / 2 = 3
        assert aggregate_loss(self.loss, self.mask, "seq_mean_token_sum").item() == pytest.approx(3.0)
        # seq_mean_token_mean: (1.5 + 3) / 2 = 2.25
        assert aggregate_loss(self.loss, self.mask, "seq_mean_token_mean").item() == pytest.approx(2.25)

    def test_policy_loss_default_is_token_mean(self):
        new, old = torch.zeros(2, 3), torch.zeros(2, 3)
        adv = -self.loss  # ratio 1: the per-token loss is -A = self.loss
        default, _ = policy_loss(new, old, adv, self.mask, 0.2)
        seq, _ = policy_loss(new, old, adv, self.mask, 0.2, loss_agg="seq_mean_token_sum")
        assert default.item() == pytest.approx(2.0) and seq.item() == pytest.approx(3.0)

    def test_unknown_name(self):
        with pytest.raises(ValueError, match="token_mean"):
            aggregate_loss(self.loss, self.mask, "sum")

"""Unit tests for ray_ppo.algo.functional: hand-worked three-element cases, plus references."""

import math

import pytest
import torch
from torch.testing import assert_close

from ray_ppo.algo import (
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


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


class TestMaskedStats:
    def test_masked_sum_mean_var(self):
        x, mask = t(1.0, 2.0, 10.0), torch.tensor([True, True, False])
        # sum = 1 + 2 = 3; mean = 1.5
        assert_close(masked_sum(x, mask), torch.tensor(3.0))
        assert_close(masked_mean(x, mask), torch.tensor(1.5))
        # squared deviations (0.25, 0.25): biased var = 0.5 / 2 = 0.25, unbiased = 0.5 / 1 = 0.5
        assert_close(masked_var(x, mask, unbiased=False), torch.tensor(0.25))
        assert_close(masked_var(x, mask), torch.tensor(0.5))

    def test_masked_mean_dim_with_int_mask_ignores_nan_padding(self):
        x = torch.tensor([[1.0, 3.0, float("nan")], [4.0, 5.0, 6.0]])
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        # row 0: (1 + 3) / 2 = 2; row 1: 4 / 1 = 4
        assert_close(masked_mean(x, mask, dim=1), t(2.0, 4.0))
        assert_close(masked_sum(x, mask, dim=1), t(4.0, 4.0))

    def test_masked_whiten_hand_worked(self):
        x, mask = t(1.0, 2.0, 3.0), torch.ones(3, dtype=torch.bool)
        # mean 2, population var (1 + 0 + 1) / 3 = 2/3 -> (x - 2) / sqrt(2/3) = (-1.224745, 0, 1.224745)
        assert_close(masked_whiten(x, mask), t(-1.224745, 0.0, 1.224745))
        # shift_mean=False adds the mean back: (0.775255, 2, 3.224745)
        assert_close(masked_whiten(x, mask, shift_mean=False), t(0.775255, 2.0, 3.224745))

    def test_masked_whiten_zero_mean_unit_var_over_valid_entries(self):
        g = torch.Generator().manual_seed(0)
        x = 3.0 + 5.0 * torch.randn(4, 7, generator=g)
        mask = torch.arange(7) < torch.tensor([[7], [3], [1], [5]])
        w = masked_whiten(x, mask)
        assert_close(masked_mean(w, mask), torch.tensor(0.0), atol=1e-5, rtol=0)
        assert_close(masked_var(w, mask, unbiased=False), torch.tensor(1.0))
        assert torch.all(w[~mask] == 0)


class TestGAE:
    def test_hand_worked_three_steps_and_padding(self):
        rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
        values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        # gamma = 0.9, lam = 0.8, gamma * lam = 0.72; V = 0 after the last valid token.
        # row 0: delta_2 = 1 - 0.7 = 0.3                  A_2 = 0.3
        #        delta_1 = 0.9 * 0.7 - 0.6 = 0.03         A_1 = 0.03 + 0.72 * 0.3   = 0.246
        #        delta_0 = 0.9 * 0.6 - 0.5 = 0.04         A_0 = 0.04 + 0.72 * 0.246 = 0.21712
        # row 1: delta_1 = 1 - 0.6 = 0.4                  A_1 = 0.4
        #        delta_0 = 0.04                           A_0 = 0.04 + 0.72 * 0.4   = 0.328
        # returns = A + V, and 0 at padding.
        advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
        assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]]))
        assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]]))

    @pytest.mark.parametrize("seed", [0, 1, 2, 3])
    def test_matches_reference_loop_on_random_lengths(self, seed):
        g = torch.Generator().manual_seed(seed)
        B, T = 6, 9
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T) < lengths[:, None]
        rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        gamma, lam = 0.5 + 0.5 * torch.rand(1, generator=g).item(), 0.95
        expected = compute_gae_reference(rewards, values, mask, gamma, lam)
        actual = compute_gae(rewards, values, mask, gamma, lam)
        assert_close(actual[0], expected[0])
        assert_close(actual[1], expected[1])
        assert torch.all(actual[0][~mask] == 0) and torch.all(actual[1][~mask] == 0)


class TestPolicyLoss:
    def test_no_clipping(self):
        ratio, adv = t(1.0, 1.1, 0.9), t(1.0, -1.0, 2.0)
        # eps_clip = 0.2 and all ratios in [0.8, 1.2]: pg_loss = -adv * ratio = (-1, 1.1, -1.8)
        # loss = (-1 + 1.1 - 1.8) / 3 = -0.566667
        loss, stats = policy_loss(ratio.log(), torch.zeros(3), adv, torch.ones(3), eps_clip=0.2)
        assert_close(loss, torch.tensor(-1.7 / 3))
        assert_close(stats["clipfrac"], torch.tensor(0.0))

    def test_clipping_engages_and_stops_gradient(self):
        log_probs = t(1.5, 0.5, 1.5).log().requires_grad_()
        adv = t(1.0, -1.0, -1.0)
        # eps_clip = 0.2: pg_loss1 = -adv * ratio, pg_loss2 = -adv * clamp(ratio, 0.8, 1.2)
        # t0: max(-1.5, -1.2) = -1.2  clipped (ratio too high with adv > 0)
        # t1: max( 0.5,  0.8) =  0.8  clipped (ratio too low with adv < 0)
        # t2: max( 1.5,  1.2) =  1.5  not clipped (the pessimistic term is the unclipped one)
        # loss = (-1.2 + 0.8 + 1.5) / 3 = 0.366667; clipfrac = 2/3
        loss, stats = policy_loss(log_probs, torch.zeros(3), adv, torch.ones(3), eps_clip=0.2)
        assert_close(loss, torch.tensor(1.1 / 3))
        assert_close(stats["clipfrac"], torch.tensor(2 / 3))
        # d loss / d logp = -adv * ratio / 3 on unclipped tokens, 0 on clipped: (0, 0, 1.5 / 3)
        loss.backward()
        assert_close(log_probs.grad, t(0.0, 0.0, 0.5))

    def test_dual_clip_bounds_negative_advantage_loss(self):
        log_probs, adv = t(4.0, 4.0, 0.5).log(), t(-1.0, 1.0, -1.0)
        # eps_clip = 0.2, dual_clip = 3
        # t0: adv < 0: max(4, 1.2) = 4, then min(4, -adv * 3 = 3) = 3
        # t1: adv > 0: max(-4, -1.2) = -1.2 (dual clip does not apply)
        # t2: adv < 0: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8
        # loss = (3 - 1.2 + 0.8) / 3 = 0.866667; without the dual clip (4 - 1.2 + 0.8) / 3 = 1.2
        loss, _ = policy_loss(log_probs, torch.zeros(3), adv, torch.ones(3), eps_clip=0.2, dual_clip=3.0)
        assert_close(loss, torch.tensor(2.6 / 3))
        loss, _ = policy_loss(log_probs, torch.zeros(3), adv, torch.ones(3), eps_clip=0.2)
        assert_close(loss, torch.tensor(1.2))

    def test_dual_clip_must_exceed_one(self):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3), eps_clip=0.2, dual_clip=1.0)

    def test_approx_kl_is_k3_and_mask_is_respected(self):
        log_probs = torch.tensor([0.0, math.log(2.0), -math.log(2.0), 123.0])
        mask = torch.tensor([True, True, True, False])
        # ratio r = (1, 2, 0.5) on valid tokens; k3 = (r - 1) - log r
        #   = (0, 1 - ln 2, -0.5 + ln 2), sum = 0.5 -> approx_kl = 0.5 / 3
        # adv = 0 everywhere -> loss = 0, whatever the masked token holds
        loss, stats = policy_loss(log_probs, torch.zeros(4), torch.zeros(4), mask, eps_clip=0.2)
        assert_close(stats["approx_kl"], torch.tensor(0.5 / 3))
        assert_close(loss, torch.tensor(0.0))
        assert not stats["approx_kl"].requires_grad and stats["approx_kl"].dim() == 0


class TestValueLoss:
    values, old_values, returns = t(1.0, 2.0, 3.0), t(1.0, 1.5, 2.0), t(1.5, 1.0, 3.0)

    def test_unclipped(self):
        # (V - R)^2 = (0.25, 1, 0) -> loss = 0.5 * 1.25 / 3 = 0.208333
        loss, stats = value_loss(self.values, self.old_values, self.returns, torch.ones(3))
        assert_close(loss, torch.tensor(0.5 * 1.25 / 3))
        assert_close(stats["vf_clipfrac"], torch.tensor(0.0))

    def test_clipped(self):
        # value_clip = 0.2: V_clipped = V_old + clamp(V - V_old, -0.2, 0.2) = (1.0, 1.7, 2.2)
        # (V_clipped - R)^2 = (0.25, 0.49, 0.64); max with (0.25, 1, 0) = (0.25, 1, 0.64)
        # loss = 0.5 * 1.89 / 3 = 0.315; the clipped error is larger only at t2 -> vf_clipfrac = 1/3
        loss, stats = value_loss(self.values, self.old_values, self.returns, torch.ones(3), value_clip=0.2)
        assert_close(loss, torch.tensor(0.315))
        assert_close(stats["vf_clipfrac"], torch.tensor(1 / 3))


class TestLogits:
    def test_entropy_matches_definition(self):
        logits = torch.tensor([[0.0, 0.0, 0.0], [1000.0, 0.0, -1000.0], [1.0, 2.0, 3.0]])
        # uniform over 3: ln 3 = 1.098612; one-hot (huge logits, must not overflow): 0
        # softmax(1, 2, 3) = (0.090031, 0.244728, 0.665241), ln p = (-2.407606, -1.407606, -0.407606)
        # -sum p ln p = 0.216760 + 0.344480 + 0.271156 = 0.832396
        assert_close(entropy_from_logits(logits), t(math.log(3), 0.0, 0.832396))

    def test_log_probs_gather_log_softmax(self):
        logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
        labels = torch.tensor([[2, 0]])
        # log softmax(1, 2, 3)[2] = 3 - logsumexp(1, 2, 3) = 3 - 3.407606 = -0.407606; uniform: -ln 3
        assert_close(log_probs_from_logits(logits, labels), torch.tensor([[-0.407606, -math.log(3)]]))


class TestKL:
    log_probs, ref_log_probs = t(-1.0, -2.0, -0.5), t(-1.5, -1.0, -0.5)

    def test_estimators_match_definitions(self):
        # d = log p - log r = (0.5, -1, 0)
        # k1 = d = (0.5, -1, 0); k2 = d^2 / 2 = (0.125, 0.5, 0)
        # k3 = exp(-d) - 1 + d = (0.606531 - 0.5, 2.718282 - 2, 0) = (0.106531, 0.718282, 0)
        assert_close(kl_k1(self.log_probs, self.ref_log_probs), t(0.5, -1.0, 0.0))
        assert_close(kl_k2(self.log_probs, self.ref_log_probs), t(0.125, 0.5, 0.0))
        assert_close(kl_k3(self.log_probs, self.ref_log_probs), t(0.106531, 0.718282, 0.0))
        for name, fn in [("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)]:
            assert_close(compute_kl(self.log_probs, self.ref_log_probs, name), fn(self.log_probs, self.ref_log_probs))

    def test_unknown_estimator_names_valid_ones(self):
        with pytest.raises(ValueError, match="k1.*k2.*k3"):
            compute_kl(self.log_probs, self.ref_log_probs, "k4")

    def test_k1_and_k3_approach_true_kl_on_samples(self):
        p, r = t(0.5, 0.3, 0.2), t(0.2, 0.3, 0.5)
        # KL(p || r) = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = 0.3 ln 2.5 = 0.274887
        true_kl = 0.3 * math.log(2.5)
        g = torch.Generator().manual_seed(0)
        x = torch.multinomial(p, 200_000, replacement=True, generator=g)
        k1, k3 = kl_k1(p.log()[x], r.log()[x]), kl_k3(p.log()[x], r.log()[x])
        # standard errors: k1 ~ 0.0016, k3 ~ 0.0005
        assert abs(k1.mean().item() - true_kl) < 0.01
        assert abs(k3.mean().item() - true_kl) < 0.005
        assert torch.all(k3 >= 0) and torch.any(k1 < 0)
        assert k3.var() < k1.var()  # 0.043 vs 0.51 for these two distributions


def test_kl_penalized_rewards_lands_score_on_last_valid_token():
    reward = t(1.0, 2.0, 3.0)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [0.6, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    # kl_coef = 0.5: -0.5 * kl on valid tokens, 0 on padding, score added at the last valid token
    # row 0: (-0.05, -0.1, -0.15 + 1 = 0.85); row 1: (-0.2, -0.25 + 2 = 1.75, 0); row 2: (-0.3 + 3 = 2.7, 0, 0)
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0], [2.7, 0.0, 0.0]])
    assert_close(kl_penalized_rewards(reward, kl, mask, kl_coef=0.5), expected)


class TestExplainedVariance:
    def test_hand_worked(self):
        values, returns = t(1.0, 2.0, 3.0), t(1.0, 2.0, 4.0)
        # Var[returns] = 14/9 (mean 7/3); returns - values = (0, 0, 1), Var = 2/9
        # EV = 1 - (2/9) / (14/9) = 6/7
        assert_close(explained_variance(values, returns, torch.ones(3)), torch.tensor(6 / 7))

    def test_perfect_critic_and_masking(self):
        values, returns = t(1.0, 2.0, 0.0), t(1.0, 2.0, 5.0)
        assert_close(explained_variance(values, returns, torch.tensor([1, 1, 0])), torch.tensor(1.0))

    def test_nan_for_constant_returns(self):
        assert torch.isnan(explained_variance(t(1.0, 2.0, 3.0), t(4.0, 4.0, 4.0), torch.ones(3)))

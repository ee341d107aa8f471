"""GSPO, CISPO, loss aggregation over filtered rows and DAPO's overlong penalty: hand-worked
numbers, and each objective against a reference written as its paper states it (plain loops over
sequences and tokens), on masks with holes (an environment's tokens inside a multi-turn episode)."""

import math

import pytest
import torch
from torch.testing import assert_close

from ray_ppo.algo import aggregate_loss, cispo_loss, gspo_loss, overlong_penalty, policy_loss

GARBAGE = 9.0  # what sits at a hole or the padding: must change nothing


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def random_case(seed: int, B: int = 5, T: int = 7):
    """Random log-probs and advantages with a mask of holes and right padding (every row keeps a token)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    mask[0, 3:] = False  # padding
    old = -torch.rand(B, T, generator=g) * 2
    new = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    advantages = torch.randn(B, 1, generator=g).expand(B, T).clone()  # one advantage per sequence
    garbage = torch.where(mask, 0.0, GARBAGE)
    return new, old + garbage, advantages + garbage, mask


class TestAggregateLoss:
    def test_a_row_without_tokens_is_no_response(self):
        loss = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
        mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # row 1 filtered out of the loss
        # token_mean: (1 + 2) / 2 = 1.5; seq_mean_token_sum: 3 over one response; seq_mean_token_mean: 1.5 / 1
        assert_close(aggregate_loss(loss, mask, "token_mean"), torch.tensor(1.5))
        assert_close(aggregate_loss(loss, mask, "seq_mean_token_sum"), torch.tensor(3.0))
        assert_close(aggregate_loss(loss, mask, "seq_mean_token_mean"), torch.tensor(1.5))

    @pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
    def test_no_token_at_all_gives_zero_and_a_zero_gradient(self, loss_agg):
        loss = torch.full((2, 3), GARBAGE, requires_grad=True)
        out = aggregate_loss(loss, torch.zeros(2, 3, dtype=torch.bool), loss_agg)
        out.backward()
        assert out.item() == 0.0 and torch.all(loss.grad == 0)


class TestGSPO:
    # Two sequences, the second with a hole at t1; pi_old = 1 (log 0), so log ratio = log pi.
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    old = torch.zeros(2, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, GARBAGE, -1.0]])

    def new(self):
        return torch.tensor([[0.1, 0.2, 0.3], [0.4, GARBAGE, -0.1]], requires_grad=True)

    def test_hand_worked(self):
        new = self.new()
        # s_0 = exp((0.1 + 0.2 + 0.3) / 3) = e^0.2 = 1.221403; s_1 = exp((0.4 - 0.1) / 2) = e^0.15 = 1.161834
        # eps 0.2: row 0, A = 1: max(-1.221403, -clip = -1.2) = -1.2 on each token (clipped)
        #          row 1, A = -1: max(1.161834, 1.161834) = 1.161834 (inside the range)
        # seq_mean_token_mean: (-1.2 + 1.161834) / 2 = -0.019083; clipfrac = 3 of 5 tokens
        loss, stats = gspo_loss(new, self.old, self.advantages, self.mask, eps_clip=0.2, loss_agg="seq_mean_token_mean")
        assert_close(loss, torch.tensor((-1.2 + math.exp(0.15)) / 2))
        assert_close(stats["clipfrac"], torch.tensor(0.6))
        # d loss / d log pi_t = -A * sg(s_i) / (|y_i| * G): row 0 clipped (0); row 1: 1.161834 / 4 = 0.290459
        loss.backward()
        assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0], [math.exp(0.15) / 4, 0.0, math.exp(0.15) / 4]]))

    def test_token_mean_weighs_tokens(self):
        # (3 * -1.2 + 2 * 1.161834) / 5 = -0.255266
        loss, _ = gspo_loss(self.new(), self.old, self.advantages, self.mask, eps_clip=0.2)
        assert_close(loss, torch.tensor((3 * -1.2 + 2 * math.exp(0.15)) / 5))

    def test_clip_higher_lets_the_first_sequence_through(self):
        # eps_clip_high 0.25: s_0 = 1.221403 < 1.25 is unclipped: (-1.221403 + 1.161834) / 2 = -0.029785
        loss, stats = gspo_loss(self.new(), self.old, self.advantages, self.mask, eps_clip=0.2, eps_clip_high=0.25,
                                loss_agg="seq_mean_token_mean")
        assert_close(loss, torch.tensor((-math.exp(0.2) + math.exp(0.15)) / 2))
        assert stats["clipfrac"].item() == 0.0

    @staticmethod
    def reference(new, old, advantages, mask, eps_low, eps_high):
        """GSPO eq. as written (Zheng et al. 2025, section 4.1), the sequence-level objective:
        J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
        s_i = (prod_t pi / pi_old)^(1 / |y_i|), with the gradient flowing through s_i."""
        terms = []
        for i in range(new.shape[0]):
            steps = mask[i].nonzero().flatten().tolist()
            ratio_product = torch.ones(())
            for s in steps:
                ratio_product = ratio_product * torch.exp(new[i, s] - old[i, s])
            s_i = ratio_product ** (1.0 / len(steps))
            A_i = advantages[i, steps[0]]
            terms.append(torch.min(s_i * A_i, torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * A_i))
        return -torch.stack(terms).mean()

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_token_form_equals_the_sequence_objective_in_value_and_gradient(self, seed):
        new, old, advantages, mask = random_case(seed)
        got, _ = gspo_loss(new, old, advantages, mask, eps_clip=0.1, eps_clip_high=0.15, loss_agg="seq_mean_token_mean")
        (got_grad,) = torch.autograd.grad(got, new)
        want = self.reference(new, old, advantages, mask, 0.1, 0.15)
        (want_grad,) = torch.autograd.grad(want, new)
        assert_close(got, want)
        assert_close(got_grad, want_grad)
        assert torch.all(got_grad[~mask] == 0)


class TestCISPO:
    # pi = (0.6, 0.2, 0.55), pi_old = (0.4, 0.4, 0.5): ratio r = (1.5, 0.5, 1.1); A = (1, -1, 2)
    old, advantages, mask = t(0.4, 0.4, 0.5).log(), t(1.0, -1.0, 2.0), torch.ones(3, dtype=torch.bool)

    def new(self):
        return t(0.6, 0.2, 0.55).log().requires_grad_()

    def test_hand_worked(self):
        new = self.new()
        # eps_high 0.2, no lower bound: r_hat = (1.2, 0.5, 1.1) (0.5 is kept: MiniMax-M1 sets no lower bound)
        # -A * r_hat * log pi = (1.2 * 0.510826, -0.5 * 1.609438, 2.2 * 0.597837) = (0.612991, -0.804719, 1.315241)
        # token mean 1.123513 / 3 = 0.374504; the weight of t0 was clipped: clipfrac 1/3
        loss, stats = cispo_loss(new, self.old, self.advantages, self.mask, eps_clip_high=0.2)
        assert_close(loss, torch.tensor(1.1235131 / 3))
        assert_close(stats["clipfrac"], torch.tensor(1 / 3))
        # gradient -A * r_hat / 3 = (-0.4, 0.166667, -0.733333): the clipped token keeps a (bounded) gradient,
        # where the PPO clip gives it none
        loss.backward()
        assert_close(new.grad, t(-0.4, 0.5 / 3, -2.2 / 3))
        ppo_new = self.new()
        policy_loss(ppo_new, self.old, self.advantages, self.mask, eps_clip=0.2)[0].backward()
        assert ppo_new.grad[0].item() == 0.0

    @staticmethod
    def reference(new, old, advantages, mask, eps_high):
        """MiniMax-M1 (section 3.1) as written: J = 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_i,t) A_i,t log pi_i,t,
        r_hat = clip(r, 1 - eps_low, 1 + eps_high) with eps_low large (no lower bound)."""
        terms = []
        for i in range(new.shape[0]):
            for s in mask[i].nonzero().flatten().tolist():
                r = math.exp(float((new[i, s] - old[i, s]).detach()))  # a number: no gradient through the weight
                terms.append(min(r, 1 + eps_high) * advantages[i, s] * new[i, s])
        return -torch.stack(terms).sum() / len(terms)

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_matches_the_paper_s_objective_on_masks_with_holes(self, seed):
        new, old, advantages, mask = random_case(seed)
        got, _ = cispo_loss(new, old, advantages, mask, eps_clip_high=0.2)
        (got_grad,) = torch.autograd.grad(got, new)
        want = self.reference(new, old, advantages, mask, 0.2)
        (want_grad,) = torch.autograd.grad(want, new)
        assert_close(got, want)
        assert_close(got_grad, want_grad)


class TestOverlongPenalty:
    def test_hand_worked(self):
        # max_new_tokens 10, buffer 4: no penalty up to 6 tokens, then (6 - |y|) / 4, -1 at the limit
        lengths = torch.tensor([5, 6, 7, 9, 10])
        assert_close(overlong_penalty(lengths, 10, 4, 1.0), t(0.0, 0.0, -0.25, -0.75, -1.0))
        assert_close(overlong_penalty(lengths, 10, 4, 0.5), t(0.0, 0.0, -0.125, -0.375, -0.5))

    def test_matches_dapo_eq_13(self):
        L_max, L_cache = 20, 6
        for length in range(1, L_max + 1):
            # Yu et al. 2025, eq. 13 (|y| <= L_max here: generation stops at the limit)
            want = 0.0 if length <= L_max - L_cache else ((L_max - L_cache) - length) / L_cache
            assert overlong_penalty(torch.tensor([length]), L_max, L_cache, 1.0).item() == pytest.approx(want)

    @pytest.mark.parametrize("buffer", [0, 10, 11])
    def test_the_buffer_lies_within_the_limit(self, buffer):
        with pytest.raises(ValueError, match="overlong buffer"):
            overlong_penalty(torch.tensor([3]), 10, buffer, 1.0)

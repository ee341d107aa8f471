"""Sequence-level truncated IS, sequence masking and IcePop: hand-worked weights and what each
reports, and each against a reference written from its definition (plain loops), on masks with
holes (an environment's tokens inside a multi-turn episode are no part of a sequence's weight).

Two sequences, the second with a hole at t1; the token weights w = pi_old / mu are

    row 0: (2, 1.5, 0.5)     product 1.5,   geometric mean 1.5^(1/3) = 1.144714
    row 1: (3, hole, 0.25)   product 0.75,  geometric mean 0.75^(1/2) = 0.866025
"""

import math

import pytest
import torch
from torch.testing import assert_close

from ray_ppo.algo import (
    correction_stats,
    geometric_mean_weights,
    icepop_weights,
    importance_weights,
    policy_loss,
    seq_mask_weights,
    seq_tis_weights,
)

GARBAGE = 9.0
MASK = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
BEHAVIOUR = torch.full((2, 3), -1.0)
OLD = BEHAVIOUR + torch.tensor([[math.log(2.0), math.log(1.5), math.log(0.5)],
                                [math.log(3.0), GARBAGE, math.log(0.25)]])


def test_seq_tis_truncates_the_sequence_s_product():
    # cap 2: products (1.5, 0.75) stay; cap 1.2: (1.2, 0.75). Every valid token carries its sequence's weight.
    assert_close(seq_tis_weights(OLD, BEHAVIOUR, MASK, 2.0), torch.tensor([[1.5, 1.5, 1.5], [0.75, 0.0, 0.75]]))
    assert_close(seq_tis_weights(OLD, BEHAVIOUR, MASK, 1.2), torch.tensor([[1.2, 1.2, 1.2], [0.75, 0.0, 0.75]]))
    assert correction_stats("seq_tis", OLD, BEHAVIOUR, MASK, 1.2)["seq_capped_frac"] == 0.5


def test_seq_mask_drops_a_sequence_whose_geometric_mean_leaves_the_band():
    assert_close(geometric_mean_weights(OLD, BEHAVIOUR, MASK), torch.tensor([1.5 ** (1 / 3), 0.75 ** 0.5]))
    # band (0.9, 1.2): row 0 (1.144714) is kept with its TIS weights (cap 2: 2, 1.5, 0.5); row 1 (0.866025) masked
    weights = seq_mask_weights(OLD, BEHAVIOUR, MASK, 2.0, (0.9, 1.2))
    assert_close(weights, torch.tensor([[2.0, 1.5, 0.5], [0.0, 0.0, 0.0]]))
    stats = correction_stats("seq_mask", OLD, BEHAVIOUR, MASK, 2.0, (0.9, 1.2))
    # one sequence of two masked; one token of five above the cap 2 (the 3)
    assert stats["seq_masked_frac"] == 0.5 and stats["is_capped_frac"] == pytest.approx(0.2)


def test_icepop_masks_tokens_outside_the_band():
    # band [0.5, 2.5]: 2, 1.5 and 0.5 (the bound itself) are kept as they are; 3 and 0.25 masked
    weights = icepop_weights(OLD, BEHAVIOUR, (0.5, 2.5))
    assert_close(weights[MASK], torch.tensor([2.0, 1.5, 0.5, 0.0, 0.0]))
    stats = correction_stats("icepop", OLD, BEHAVIOUR, MASK, 2.0, (0.5, 2.5))
    # mean (2 + 1.5 + 0.5 + 3 + 0.25) / 5 = 1.45, max 3; 2 of 5 tokens masked; no cap: no is_capped_frac
    assert stats == pytest.approx({"is_weight_mean": 1.45, "is_weight_max": 3.0, "icepop_masked_frac": 0.4})


def test_a_masked_token_adds_nothing_to_the_loss_but_counts_in_its_denominator():
    # PPO on pi = pi_old (ratio 1) with A = 1: each token's loss is -w; icepop weights (2, 1.5, 0.5 | 0, -, 0)
    # token mean over the 5 valid tokens: -(2 + 1.5 + 0.5) / 5 = -0.8
    weights = icepop_weights(OLD, BEHAVIOUR, (0.5, 2.5))
    loss, _ = policy_loss(OLD, OLD, torch.ones(2, 3), MASK, 0.2, is_weights=weights)
    assert_close(loss, torch.tensor(-0.8))


def reference(mode: str, old, behaviour, mask, cap, band):
    """Each correction from its definition, sequence by sequence and token by token."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        steps = mask[i].nonzero().flatten().tolist()
        w = [math.exp(float(old[i, s] - behaviour[i, s])) for s in steps]
        product = math.prod(w)
        geometric = product ** (1 / len(steps))
        for s, w_t in zip(steps, w):
            if mode == "seq_tis":  # min(prod_t w_t, C)
                out[i, s] = min(product, cap)
            elif mode == "seq_mask":  # token TIS, and the sequence only if its geometric mean is in the band
                out[i, s] = min(w_t, cap) if band[0] <= geometric <= band[1] else 0.0
            elif mode == "icepop":  # IcePop's M(k) = k on [alpha, beta], else 0
                out[i, s] = w_t if band[0] <= w_t <= band[1] else 0.0
    return out


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mask", "icepop"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_matches_its_definition_on_masks_with_holes(mode, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 8
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[:, 0] = True
    behaviour = -torch.rand(B, T, generator=g) * 3
    old = behaviour + 0.05 * torch.randn(B, T, generator=g)  # weights near 1, some outside the bands
    old = torch.where(mask, old, GARBAGE)  # an environment's tokens and the padding hold anything
    band = (0.95, 1.05) if mode == "icepop" else (0.99, 1.01)
    got = importance_weights(mode, old, behaviour, mask, 1.1, band)
    assert_close(got[mask], reference(mode, old, behaviour, mask, 1.1, band)[mask])
    if mode != "icepop":  # sequence weights are 0 off the mask
        assert torch.all(got[~mask] == 0)


def test_bands_must_hold_one():
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        icepop_weights(OLD, BEHAVIOUR, (1.2, 5.0))
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        seq_mask_weights(OLD, BEHAVIOUR, MASK, 2.0, (0.9, 0.95))
    with pytest.raises(ValueError, match="seq_tis, seq_mask, icepop"):
        importance_weights("none", OLD, BEHAVIOUR, MASK, 2.0)

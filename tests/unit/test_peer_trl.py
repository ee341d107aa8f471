"""The peer benchmark's own logic (``benchmarks/peer_trl.py``): its paired reward test and the
diagnostic that trains ours with TRL's loss mask. No TRL needed: neither touches it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peer_trl  # noqa: E402

PAD, EOS = 0, 1


def test_trl_loss_mask_stops_at_the_first_sampled_pad_and_restores_the_sampler(monkeypatch):
    from ray_ppo.core import experience
    from ray_ppo.core.models import Rollout, response_mask

    responses = torch.tensor([[5, 6, PAD, 7, 8],    # a pad the policy sampled: TRL's end
                              [5, EOS, PAD, PAD, PAD],  # EOS, then HF's padding: EOS kept, as TRL
                              [5, 6, 7, 8, 9],      # neither: whole
                              [PAD, 6, 7, EOS, PAD]])  # a pad first: its first token kept (ours needs one)
    prompts = torch.full((4, 2), 4)
    rollout = Rollout(torch.cat([prompts, responses], 1), torch.ones(4, 7, dtype=torch.long),
                      response_mask(responses, EOS), prompt_len=2)

    def sample(model, prompts, params, pad_token_id, eos_token_id):
        return rollout

    monkeypatch.setattr(experience, "generate", sample)
    with peer_trl.trl_loss_mask():
        cut = experience.generate(None, [], None, PAD, EOS)
    assert experience.generate is sample
    assert cut.action_mask.tolist() == [[True, True, False, False, False],
                                        [True, True, False, False, False],
                                        [True] * 5,
                                        [True, False, False, False, False]]
    assert torch.equal(cut.sequences, rollout.sequences)  # the reward still reads the whole response
    assert torch.equal(cut.attention_mask, rollout.attention_mask)


def test_paired_reward_difference_is_an_exact_sign_flip_test():
    d = peer_trl.paired_reward_difference([0.1, 0.2, 0.3], [0.2, 0.4, 0.6])
    assert d["higher"] == 3 and d["rounds"] == 3
    assert d["mean"] == pytest.approx(0.2) and d["median"] == pytest.approx(0.2)
    assert d["p"] == pytest.approx(2 / 8)  # only all-plus and all-minus are as extreme
    assert peer_trl.paired_reward_difference([0.5, 0.5], [0.4, 0.6])["p"] == 1.0

"""The peer benchmark's own logic (``benchmarks/peer_trl.py``): its paired reward test, the
diagnostic that trains ours with TRL's loss mask, and the toy reward model TRL scores with (whole
responses, or up to the first pad). No TRL needed: none of them touches it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peer_trl  # noqa: E402

PAD, EOS = 0, 1


def test_trl_loss_mask_stops_at_the_first_sampled_pad_and_restores_the_sampler(monkeypatch):
    from ray_ppo.makers import experience
    from ray_ppo.models import Rollout, response_mask

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


@pytest.mark.parametrize("pad_ends", [False, True])
def test_toy_reward_model_scores_past_a_pad_as_trl_reads_it_or_up_to_it_as_ours(pad_ends):
    from ray_ppo.models import ensure_tiny_model, load_tokenizer
    from ray_ppo.tasks.toy import reward

    tokenizer = load_tokenizer(str(ensure_tiny_model("lm")))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    query = torch.tensor([tokenizer("3 1 4")["input_ids"]] * 3)
    seven, four = tokenizer.convert_tokens_to_ids(["7", "4"])
    responses = torch.tensor([[four, four, pad, four, four],  # a sampled pad, right answers after it
                              [four, eos, pad, pad, pad],     # EOS, then TRL's padding
                              [seven, four, four, four, four]])
    ids = torch.cat([query, responses], 1)
    attention = ids != pad  # as TRL's get_reward masks pads (and feeds the backbone 0 there)
    model = peer_trl.toy_reward_model(tokenizer, query.shape[1], pad_ends=pad_ends)
    scores = model.scorer(input_ids=ids.masked_fill(~attention, 0), attention_mask=attention).hidden_states[-1]
    read = ["4 4", "4", "7 4 4 4 4"] if pad_ends else ["4 4 4 4", "4", "7 4 4 4 4"]
    expected = reward(["3 1 4"] * 3, read)
    assert scores[:, -1, 0].tolist() == expected
    assert expected[0] == (2 / 8 if pad_ends else 4 / 8)  # the pad row is what the option changes
    assert model.batch_means == [pytest.approx(sum(expected) / 3)]


def test_cut_at_first_pad_pads_everything_from_the_first_pad_on():
    cut = peer_trl.cut_at_first_pad(torch.tensor([[5, PAD, 6], [5, 6, 7], [PAD, 5, PAD]]), PAD)
    assert cut.tolist() == [[5, PAD, PAD], [5, 6, 7], [PAD, PAD, PAD]]

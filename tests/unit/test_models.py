"""Unit tests of ray_ppo.models: the tiny offline models, padding, generation, log-probs, critic, reward model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_ppo.models import (
    Critic,
    RewardModel,
    SamplingParams,
    action_log_probs,
    action_values,
    ensure_tiny_model,
    generate,
    left_pad,
    load_actor,
    load_reward_fn,
    position_ids_from_mask,
    response_mask,
    stop_token_ids,
    torch_dtype,
)
from ray_ppo.models.tiny import TINY_NAME, resolve_pretrained, tiny_gpt2_config

PAD, EOS = 0, 1  # ids of <pad> and <eos> in the tiny tokenizer: <pad> <eos> <unk> 0 1 ... 9


def digit(d: int) -> int:
    """Token id of the word ``str(d)`` in the tiny tokenizer (the digits follow the 3 special tokens)."""
    return 3 + d


@pytest.fixture(scope="module")
def actor(tiny_path):
    return load_actor(tiny_path)


# -- the tiny models ----------------------------------------------------------------------------


def test_tiny_model_loads_through_the_ordinary_from_pretrained_path(tiny_path, tiny_model_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert Path(tiny_path) == Path(tiny_model_cache).resolve() / "tiny-lm"
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.config.n_layer == 2 and model.config.vocab_size == 13
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (PAD, EOS, 2)
    assert tokenizer("3 1 4", add_special_tokens=False)["input_ids"] == [digit(3), digit(1), digit(4)]
    assert tokenizer.decode([digit(7), EOS, PAD], skip_special_tokens=True) == "7"
    logits = model(input_ids=torch.tensor([[digit(3), digit(1)]])).logits
    assert logits.shape == (1, 2, 13)


def test_load_tokenizer_pads_on_the_left(tokenizer):
    batch = tokenizer(["5", "1 2 3"], padding=True, add_special_tokens=False)
    assert batch["input_ids"] == [[PAD, PAD, digit(5)], [digit(1), digit(2), digit(3)]]
    assert batch["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_ensure_tiny_model_builds_once(tiny_path, tiny_reward_path):
    config_file = Path(tiny_path) / "config.json"
    mtime = config_file.stat().st_mtime_ns
    assert ensure_tiny_model("lm") == Path(tiny_path)
    assert config_file.stat().st_mtime_ns == mtime
    assert resolve_pretrained(TINY_NAME) == tiny_path
    assert resolve_pretrained("tiny-reward") == tiny_reward_path
    assert resolve_pretrained("gpt2") == "gpt2"
    # the build went through a staging directory that was renamed into place: nothing is left behind
    assert {"tiny-lm", "tiny-reward"} <= {p.name for p in Path(tiny_path).parent.iterdir()}
    assert not [p for p in Path(tiny_path).parent.iterdir() if p.name.startswith(".tiny-")]


def test_ensure_tiny_model_in_an_explicit_root(tmp_path):
    path = ensure_tiny_model("lm", root=tmp_path)
    assert path == tmp_path / "tiny-lm"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-lm"]
    with pytest.raises(ValueError, match="unknown tiny model kind 'big'"):
        ensure_tiny_model("big", root=tmp_path)


def test_tiny_models_are_deterministic(tmp_path, tiny_path):
    from safetensors.torch import load_file

    other = ensure_tiny_model("lm", root=tmp_path)
    a, b = load_file(str(Path(tiny_path) / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- padding and masks --------------------------------------------------------------------------


def test_left_pad_layout():
    input_ids, attention_mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert input_ids.dtype == attention_mask.dtype == torch.long


@pytest.mark.parametrize("prompts", [[], [[1, 2], []]])
def test_left_pad_rejects_empty_prompts(prompts):
    with pytest.raises(ValueError, match="at least one token"):
        left_pad(prompts, pad_token_id=0)


def test_response_mask_includes_the_first_eos_and_masks_what_follows():
    responses = torch.tensor([
        [7, EOS, 8, EOS],  # EOS in the middle: it counts, the rest does not
        [EOS, 5, 6, 7],    # EOS first: only it counts
        [4, 5, 6, 7],      # no EOS: everything counts
        [4, 5, 6, EOS],    # EOS last
    ])
    assert response_mask(responses, EOS).tolist() == [
        [True, True, False, False],
        [True, False, False, False],
        [True, True, True, True],
        [True, True, True, True],
    ]
    assert response_mask(responses, None).all()
    assert response_mask(responses, None).dtype == torch.bool


def test_response_mask_ends_at_the_first_of_several_end_tokens():
    responses = torch.tensor([
        [7, PAD, 8, EOS],  # a pad first: it ends the response
        [7, EOS, PAD, 8],  # an EOS first
        [4, 5, 6, 7],      # neither: everything counts
    ])
    assert response_mask(responses, (EOS, PAD)).tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, True, True],
    ]
    assert torch.equal(response_mask(responses, [EOS]), response_mask(responses, EOS))
    assert response_mask(responses, ()).all()


def test_stop_token_ids_are_the_eos_the_checkpoints_end_ids_and_the_pad(tiny_path):
    from ray_ppo.models import load_tokenizer

    tokenizer, model = load_tokenizer(tiny_path), load_actor(tiny_path)
    assert stop_token_ids(tokenizer, model) == stop_token_ids(tokenizer) == (EOS, PAD)
    # a checkpoint whose generation_config.json lists two end ids (as Llama-3-Instruct's does)
    model.generation_config.eos_token_id = [digit(9), EOS]
    try:
        assert stop_token_ids(tokenizer, model) == (EOS, digit(9), PAD)
    finally:
        model.generation_config.eos_token_id = EOS


def test_a_sampled_pad_ends_its_response(actor):
    """The random tiny model samples ``<pad>`` ~1 token in 13: such a response ends there, as at an
    EOS, and no response holds an end token before its last."""
    prompts = [[digit(d % 10)] for d in range(64)]
    torch.manual_seed(0)
    rollout = generate(actor, prompts, SamplingParams(max_new_tokens=8), PAD, (EOS, PAD))
    responses, lengths = rollout.sequences[:, rollout.prompt_len:], rollout.action_mask.sum(1)
    last = responses[torch.arange(len(prompts)), lengths - 1]
    ended = lengths < rollout.num_actions
    assert (last[ended] == PAD).any() and (last[ended] == EOS).any()  # both ends happen
    assert torch.isin(last[ended], torch.tensor([EOS, PAD])).all()
    inside = rollout.action_mask & (torch.arange(rollout.num_actions) < (lengths - 1).unsqueeze(1))
    assert not torch.isin(responses[inside], torch.tensor([EOS, PAD])).any()
    assert (responses[~rollout.action_mask] == PAD).all()
    # HF generate itself stopped those rows: the same seed without the pad as an end token samples on
    torch.manual_seed(0)
    through = generate(actor, prompts, SamplingParams(max_new_tokens=8), PAD, EOS)
    assert through.action_mask.sum() > rollout.action_mask.sum()


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 2], [0, 1, 2, 3]]


# -- generation ---------------------------------------------------------------------------------


def test_generate_layout(actor):
    prompts = [[digit(d) for d in range(n)] for n in (1, 3, 5, 2)] * 8  # 32 rows, prompt widths 1..5
    torch.manual_seed(0)
    rollout = generate(actor, prompts, SamplingParams(max_new_tokens=6), PAD, EOS)
    B, P = len(prompts), 5
    assert rollout.prompt_len == P
    assert 1 <= rollout.num_actions <= 6
    assert rollout.sequences.shape == rollout.attention_mask.shape == (B, P + rollout.num_actions)
    assert rollout.action_mask.shape == (B, rollout.num_actions) and rollout.action_mask.dtype == torch.bool

    input_ids, prompt_mask = left_pad(prompts, PAD)
    assert torch.equal(rollout.sequences[:, :P], input_ids)
    assert torch.equal(rollout.attention_mask, torch.cat([prompt_mask, rollout.action_mask.long()], dim=1))
    responses = rollout.sequences[:, P:]
    assert torch.equal(rollout.action_mask, response_mask(responses, EOS))
    assert (responses[~rollout.action_mask] == PAD).all()
    # a random 13-token model stops early on some rows (P(no EOS in 32 x 6 draws) ~ 1e-7), so the
    # masking after EOS is exercised: every masked-out row ends with its first EOS
    stopped = rollout.action_mask.sum(1) < rollout.num_actions
    assert stopped.any()
    last = rollout.action_mask.sum(1) - 1
    assert (responses[stopped, last[stopped]] == EOS).all()
    assert rollout.action_mask[:, 0].all()


def test_generate_without_eos_keeps_every_token(actor):
    torch.manual_seed(0)
    rollout = generate(actor, [[digit(1)], [digit(2), digit(3)]], SamplingParams(max_new_tokens=4), PAD, None)
    assert rollout.num_actions == 4
    assert rollout.action_mask.all()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5)])
def test_generate_gives_the_log_probs_a_forward_pass_gives(actor, temperature, top_k):
    """The behaviour log-probs a maker reads from generation: log_softmax(logits / T) of each sampled
    token, as a forward pass over the finished sequences computes them (top-k cuts the sampling, not
    the log-probs, in both), and 0 past each response's EOS."""
    prompts = [[digit(d) for d in range(n)] for n in (1, 3, 5, 2)] * 8
    torch.manual_seed(0)
    rollout = generate(actor, prompts, SamplingParams(max_new_tokens=6, temperature=temperature, top_k=top_k),
                       PAD, EOS, log_probs=True)
    mask = rollout.action_mask
    assert (mask.sum(1) < rollout.num_actions).any()  # rows that stopped early: the positions past EOS are 0
    forward = action_log_probs(actor, rollout.sequences, rollout.attention_mask, rollout.num_actions, temperature)
    assert rollout.log_probs.shape == mask.shape and rollout.log_probs.dtype == torch.float32
    torch.testing.assert_close(rollout.log_probs, forward * mask, atol=1e-5, rtol=0)
    assert (rollout.log_probs[~mask] == 0).all() and (rollout.log_probs[mask] < 0).all()
    assert generate(actor, prompts, SamplingParams(max_new_tokens=6), PAD, EOS).log_probs is None


def test_generate_samples_with_the_sampling_params_alone(actor, tmp_path, caplog):
    """A checkpoint whose generation_config.json bans a token (or sets a repetition penalty) would
    have transformers apply it to every ``generate`` call; the maker's samples and PPO's log-probs
    are the policy's alone, so ``generate`` leaves it out, says so once, and leaves the model's
    config as it was."""
    import copy
    import logging

    banned = digit(7)
    actor = copy.deepcopy(actor)
    actor.generation_config.bad_words_ids = [[banned]]
    actor.save_pretrained(tmp_path / "banned")
    actor = load_actor(str(tmp_path / "banned"))  # the setting comes from the checkpoint's file
    assert actor.generation_config.bad_words_ids == [[banned]]
    prompts, params = [[digit(1), digit(2)]] * 64, SamplingParams(max_new_tokens=6)
    torch.manual_seed(0)
    plain = actor.generate(input_ids=torch.tensor(prompts), do_sample=True, max_new_tokens=6, pad_token_id=PAD,
                           eos_token_id=EOS, top_k=0)
    assert not (plain[:, 2:] == banned).any()  # transformers applies it
    with caplog.at_level(logging.WARNING, logger="ray_ppo.models.generation"):
        for _ in range(2):
            rollout = generate(actor, prompts, params, PAD, EOS)
            assert (rollout.sequences[:, 2:][rollout.action_mask] == banned).any()
    told = [r.getMessage() for r in caplog.records if "bad_words_ids" in r.getMessage()]
    assert told == [f"the checkpoint's generation settings bad_words_ids=[[{banned}]] are not applied: responses "
                    f"are sampled with maker.temperature, maker.top_k and maker.top_p only, the distribution "
                    f"PPO's log-probs describe"]
    assert actor.generation_config.bad_words_ids == [[banned]]


# -- log-probs, values, reward model on padded batches -------------------------------------------


def padded_batch():
    """Three sequences of different lengths with 3 response tokens each, left-padded together."""
    rows = [
        [digit(3), digit(1), digit(4), digit(1), digit(5)],
        [digit(9), digit(2), digit(6), digit(0)],
        [digit(5), digit(3), digit(5), digit(8), digit(9), digit(7)],
    ]
    sequences, attention_mask = left_pad(rows, PAD)
    return rows, sequences, attention_mask


def test_action_log_probs_of_a_padded_batch_match_each_row_alone(actor):
    rows, sequences, attention_mask = padded_batch()
    batched = action_log_probs(actor, sequences, attention_mask, num_actions=3)
    assert batched.shape == (3, 3)
    alone = torch.cat([
        action_log_probs(actor, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long), num_actions=3)
        for row in rows
    ])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert (batched < 0).all()
    # the comparison is sensitive to positions: counting positions from column 0 (ignoring the
    # left padding) changes the log-probs of the padded row
    columns = torch.arange(sequences.shape[1]).expand_as(sequences)
    logits = actor(input_ids=sequences, attention_mask=attention_mask, position_ids=columns).logits[:, -4:-1]
    naive = torch.log_softmax(logits, -1).gather(-1, sequences[:, -3:, None]).squeeze(-1)
    assert (naive[1] - alone[1]).abs().max() > 1e-3


def test_action_log_probs_divide_logits_by_the_temperature(actor):
    _, sequences, attention_mask = padded_batch()
    hot = action_log_probs(actor, sequences, attention_mask, num_actions=3, temperature=2.0)
    logits = actor(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits[:, -4:-1] / 2.0
    expected = torch.log_softmax(logits, -1).gather(-1, sequences[:, -3:, None]).squeeze(-1)
    torch.testing.assert_close(hot, expected, atol=1e-5, rtol=0)


def test_critic_round_trip(tiny_path, tmp_path):
    critic = Critic.from_pretrained(tiny_path)
    assert torch.equal(critic.value_head.bias, torch.zeros(1))  # no value_head.safetensors next to the LM
    with torch.no_grad():
        critic.value_head.bias.fill_(0.25)
    rows, sequences, attention_mask = padded_batch()
    values = action_values(critic, sequences, attention_mask, num_actions=3)
    assert values.shape == (3, 3) and values.dtype == torch.float32

    critic.save_pretrained(tmp_path)
    assert (tmp_path / "value_head.safetensors").exists()
    loaded = Critic.from_pretrained(str(tmp_path))
    assert torch.equal(loaded.value_head.bias, torch.tensor([0.25]))
    assert torch.equal(loaded.value_head.weight, critic.value_head.weight)
    torch.testing.assert_close(action_values(loaded, sequences, attention_mask, 3), values, atol=0, rtol=0)
    # values are position-correct too: row 1 alone gives the same values
    alone = action_values(critic, torch.tensor([rows[1]]), torch.ones(1, 4, dtype=torch.long), 3)
    torch.testing.assert_close(alone[0], values[1], atol=1e-5, rtol=0)


def test_reward_model_scores_the_last_attended_token(tiny_reward_path):
    from transformers import AutoModelForSequenceClassification

    reward_model = RewardModel.from_pretrained(tiny_reward_path)
    short = [digit(4), digit(2), PAD]  # a real token equal to the pad id (as when EOS is the pad token)
    long = [digit(1), digit(2), digit(3), digit(4), digit(5)]
    left = torch.tensor([[PAD, PAD] + short, long])
    left_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    right = torch.tensor([short + [PAD, PAD], long])
    right_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])

    alone = torch.cat([reward_model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in (short, long)])
    assert alone.shape == (2,)
    torch.testing.assert_close(reward_model(left, left_mask), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(reward_model(right, right_mask), alone, atol=1e-5, rtol=0)
    # and it is the classifier's own score on an unpadded sequence without pad tokens
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_reward_path)
    torch.testing.assert_close(hf(input_ids=torch.tensor([long])).logits[:, 0], alone[1:], atol=1e-5, rtol=0)
    assert alone[0] != alone[1]


def test_reward_model_needs_one_label(tmp_path):
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    config = tiny_gpt2_config(13)
    config.num_labels = 2
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2; it needs exactly 1"):
        RewardModel.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no 'score' or 'classifier' head"):
        RewardModel(GPT2LMHeadModel(tiny_gpt2_config(13)))


# -- rule rewards and dtypes --------------------------------------------------------------------


def test_load_reward_fn_imports_module_function():
    from ray_ppo.tasks import toy

    fn = load_reward_fn("ray_ppo.tasks.toy:reward")
    assert fn is toy.reward
    assert fn(["1 2 3"], ["3 3 3 3 3 3 3 3"]) == [1.0]


@pytest.mark.parametrize("spec", ["ray_ppo.tasks.toy", "ray_ppo.tasks.toy:", ":reward", "", "a.b.c"])
def test_load_reward_fn_rejects_bad_specs(spec):
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    assert repr(spec) in str(info.value)
    assert "must look like 'package.module:function'" in str(info.value)


@pytest.mark.parametrize("spec, cause", [
    ("ray_ppo.no_such_module:reward", "No module named 'ray_ppo.no_such_module'"),
    ("ray_ppo.tasks.toy:no_such_fn", "no_such_fn"),
    ("ray_ppo.tasks.toy:TARGET_LEN", "is not callable"),
])
def test_load_reward_fn_names_the_spec_when_it_cannot_load(spec, cause):
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    assert repr(spec) in str(info.value)
    assert cause in str(info.value)


def test_torch_dtype():
    assert torch_dtype("float32") is torch.float32
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match=r"unknown dtype 'fp16'; choose one of \['bfloat16', 'float16', 'float32'\]"):
        torch_dtype("fp16")


def test_load_actor_in_bfloat16(tiny_path):
    model = load_actor(tiny_path, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    config = json.loads((Path(tiny_path) / "config.json").read_text())
    assert config["n_layer"] == 2


def test_action_logits_ask_the_model_for_the_response_positions_only(actor):
    """transformers' ``logits_to_keep``: the vocabulary-wide logits of the prompt are never made (a
    fifth of SmolLM2's forward pass is its 49,152-wide head), through peft and DDP-style wrappers;
    a model whose forward lacks the keyword gets the plain call."""
    from peft import LoraConfig, get_peft_model

    from ray_ppo.models.hf import action_logits, keeps_logits

    _, sequences, attention_mask = padded_batch()
    shapes = []
    hook = actor.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        action_logits(actor, sequences, attention_mask, num_actions=3)
    finally:
        hook.remove()
    assert shapes == [(3, 4, actor.config.vocab_size)]  # 3 actions + the position before the first

    class Wrapper(torch.nn.Module):  # as DDP and ColossalAI's wrappers: forward(*args, **kwargs) -> module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
            return actor(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    peft_actor = get_peft_model(load_actor(resolve_pretrained(TINY_NAME)), LoraConfig(r=2, target_modules=["c_attn"]))
    assert keeps_logits(actor) and keeps_logits(Wrapper(actor)) and keeps_logits(Wrapper(peft_actor))
    assert not keeps_logits(Plain())
    torch.testing.assert_close(action_logits(Plain(), sequences, attention_mask, 3),
                               action_logits(Wrapper(actor), sequences, attention_mask, 3), atol=1e-5, rtol=0)

"""Packed passes (ray_ppo.models.packing) give the padded passes' log-probs, entropies, values and
gradients: float32, 1e-5, on batches with left padding, right padding, prompts shared by several
rows and episodes whose action masks have holes; on the tiny GPT-2 (learned positions) and a tiny
Llama (rotary positions, grouped-query attention, SmolLM2's architecture), with and without LoRA.
A position or a mask boundary off by one moves a log-prob by far more than 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.algo.experience import ExperienceBatch
from ray_ppo.models import Critic, action_log_probs, action_values, load_actor
from ray_ppo.models.hf import action_log_probs_and_entropy, position_ids_from_mask
from ray_ppo.models.packing import Layout, enable_packing, packs, prompt_groups

ATOL = 1e-5


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    """A tiny random Llama saved to disk: rotary positions, 4 query heads over 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def batch(vocab: int, seed: int = 0) -> ExperienceBatch:
    """Seven rows: prompt A answered three times, B twice, C and D once (A..D of lengths 5, 3, 7, 2),
    responses of 1 to 6 tokens, and one episode whose action mask has a hole."""
    g = torch.Generator().manual_seed(seed)
    prompts = {name: torch.randint(1, vocab, (n,), generator=g) for name, n in zip("ABCD", (5, 3, 7, 2))}
    rows = [("A", 4), ("B", 6), ("A", 1), ("C", 3), ("A", 5), ("B", 2), ("D", 6)]
    items = []
    for i, (name, r) in enumerate(rows):
        item = ExperienceItem.filled(prompts[name], torch.randint(1, vocab, (r,), generator=g), reward=0.0,
                                     policy_version=0, uid=str(i))
        if i == 6:
            item.action_mask = torch.tensor([True, True, False, False, True, True])
        items.append(item)
    return ExperienceBatch.merge(items, pad_token_id=0)


def weights_of(b: ExperienceBatch, seed: int = 1) -> torch.Tensor:
    return torch.randn(b.action_mask.shape, generator=torch.Generator().manual_seed(seed)) * b.action_mask


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def padded_and_packed(model_of, run):
    """``run(model)`` on a padded model and on a packed copy: (its outputs and gradients) for each."""
    padded = model_of()
    packed = copy.deepcopy(padded)
    assert enable_packing(packed) is None and packs(packed) and not packs(padded)
    out = []
    for model in (padded, packed):
        model.zero_grad(set_to_none=True)
        values, loss = run(model)
        loss.backward()
        out.append((values, grads(model)))
    return out


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=0, msg=f"gradient of {name}")


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_pass(which, tiny_path, llama_path):
    path = tiny_path if which == "gpt2" else llama_path
    torch.manual_seed(0)
    b = batch(vocab=load_actor(path).config.vocab_size)
    w = weights_of(b)
    mask = b.action_mask

    def run(model):
        log_probs, entropy = action_log_probs_and_entropy(model, b.sequences, b.attention_mask, b.num_actions,
                                                          temperature=0.7, entropy=True)
        return (log_probs * mask, entropy * mask), (log_probs * w).sum() + 0.1 * (entropy * mask).sum()

    (padded, padded_grads), (packed, packed_grads) = padded_and_packed(lambda: load_actor(path), run)
    for a, p in zip(padded, packed):
        torch.testing.assert_close(p, a, atol=ATOL, rtol=0)
    assert_close(padded_grads, packed_grads)


def varlen_reference(calls: list):
    """``torch.nn.attention.varlen.varlen_attn`` written from its documentation, in plain torch: the
    kernel itself (FlashAttention) runs on CUDA only, and this machine has none. Segment i's queries
    are ``q[cu_q[i]:cu_q[i+1]]``, its keys and values ``k[cu_k[i]:cu_k[i+1]]``; ``window_size=(-1, 0)``
    is causal attention aligned at the bottom right (query j of Lq sees keys up to j + Lk - Lq, as
    PyTorch's ``causal_lower_right`` bias); with ``enable_gqa`` each key/value head serves
    H_q / H_kv consecutive query heads."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append((cu_q.dtype, cu_k.dtype, window_size))
        assert window_size == (-1, 0) and enable_gqa == (k.shape[1] != q.shape[1])
        out = []
        for i in range(cu_q.numel() - 1):
            qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
            assert qi.shape[0] <= max_q and ki.shape[0] <= max_k
            if enable_gqa:
                ki, vi = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (ki, vi))
            lq, lk = qi.shape[0], ki.shape[0]
            bias = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)  # causal, aligned at the bottom right
            o = torch.nn.functional.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                                                 vi.transpose(0, 1), attn_mask=bias, scale=scale)
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    return attend


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_the_varlen_kernel_path_gives_the_padded_pass(which, tiny_path, llama_path, monkeypatch):
    """On a GPU in half precision a packed pass's attention is one variable-length FlashAttention
    call (queries: the packed row; keys: each segment's prompt and itself). Its arguments, given to
    a plain-torch twin of the kernel here, give the padded pass's log-probs and gradients."""
    from ray_ppo.models import packing

    calls: list = []
    monkeypatch.setattr(packing, "_varlen_attn", varlen_reference(calls))
    monkeypatch.setattr(packing, "_uses_varlen", lambda query, dropout: dropout == 0.0)
    path = tiny_path if which == "gpt2" else llama_path
    b = batch(vocab=load_actor(path).config.vocab_size, seed=3)
    w = weights_of(b)

    def run(model):
        log_probs = action_log_probs(model, b.sequences, b.attention_mask, b.num_actions)
        return log_probs * b.action_mask, (log_probs * w).sum()

    (padded, padded_grads), (packed, packed_grads) = padded_and_packed(lambda: load_actor(path), run)
    torch.testing.assert_close(packed, padded, atol=ATOL, rtol=0)
    assert_close(padded_grads, packed_grads)
    layers = load_actor(path).config.num_hidden_layers
    assert len(calls) == layers and calls[0] == (torch.int32, torch.int32, (-1, 0))  # one call a layer, packed only


def test_only_a_cuda_half_precision_query_takes_the_varlen_kernel():
    from ray_ppo.models import packing

    assert not packing._uses_varlen(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 0.0)  # CPU: SDPA with its mask
    if packing._varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    if torch.cuda.is_available():
        query = torch.zeros(1, 2, 3, 4, device="cuda")
        assert not packing._uses_varlen(query, 0.0)  # float32: FlashAttention has no float32 kernel
        assert packing._uses_varlen(query.bfloat16(), 0.0) and not packing._uses_varlen(query.bfloat16(), 0.1)


def test_packed_critic_values_and_gradients_equal_the_padded_pass(llama_path):
    torch.manual_seed(0)
    b = batch(vocab=64)
    w = weights_of(b)

    def run(critic):
        values = action_values(critic, b.sequences, b.attention_mask, b.num_actions)
        return values * b.action_mask, (values * w).sum()

    (padded, padded_grads), (packed, packed_grads) = padded_and_packed(lambda: Critic.from_pretrained(llama_path), run)
    torch.testing.assert_close(packed, padded, atol=ATOL, rtol=0)
    assert_close(padded_grads, packed_grads)


def test_packed_lora_gradients_equal_the_padded_pass(llama_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    b = batch(vocab=64)
    w = weights_of(b)

    def lora_actor():
        torch.manual_seed(3)
        model = get_peft_model(load_actor(llama_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # nonzero B, so every adapter has a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        return model

    def run(model):
        log_probs = action_log_probs(model, b.sequences, b.attention_mask, b.num_actions)
        return log_probs * b.action_mask, (log_probs * w).sum()

    (padded, padded_grads), (packed, packed_grads) = padded_and_packed(lora_actor, run)
    torch.testing.assert_close(packed, padded, atol=ATOL, rtol=0)
    assert padded_grads and all("lora_" in name for name in padded_grads)
    assert_close(padded_grads, packed_grads)


def test_a_layout_computes_each_shared_prompt_once_and_no_padding():
    b = batch(vocab=64)
    layout = Layout.of(b.sequences, b.attention_mask, b.num_actions)
    assert prompt_groups(b.sequences, b.attention_mask, b.num_actions) == [[0, 2, 4], [1, 5], [3], [6]]
    responses = int(b.attention_mask[:, b.prompt_len:].sum())
    assert layout.num_tokens == (5 + 3 + 7 + 2) + responses  # each prompt once, every response token
    assert layout.keep.numel() == responses and layout.shape == tuple(b.action_mask.shape)
    # each response continues its prompt's positions, as the padded batch counts them
    padded_positions = position_ids_from_mask(b.attention_mask)[:, b.prompt_len:]
    packed_positions = layout.position_ids[0, layout.keep] + 1
    assert torch.equal(packed_positions, padded_positions[layout.rows, layout.cols])
    unshared = Layout.of(b.sequences, b.attention_mask, b.num_actions, share_prompts=False)
    assert unshared.num_tokens == int(b.attention_mask.sum())
    assert len(unshared.segments) == b.batch_size and all(s.prefix is None for s in unshared.segments)


def test_a_packing_model_s_padded_passes_and_generation_are_unchanged(tiny_path, tokenizer):
    from ray_ppo.models import SamplingParams, generate

    b = batch(vocab=len(tokenizer))
    model = load_actor(tiny_path)
    before = model(input_ids=b.sequences, attention_mask=b.attention_mask,
                   position_ids=position_ids_from_mask(b.attention_mask)).logits
    prompts = [[3, 4, 5], [6, 7]]
    sampling = SamplingParams(max_new_tokens=5)
    sample = lambda: generate(model, prompts, sampling, tokenizer.pad_token_id, tokenizer.eos_token_id,  # noqa: E731
                              greedy=True).sequences
    generated = sample()
    assert enable_packing(model) is None
    after = model(input_ids=b.sequences, attention_mask=b.attention_mask,
                  position_ids=position_ids_from_mask(b.attention_mask)).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert torch.equal(sample(), generated)


def test_a_model_that_cannot_pack_says_why_and_stays_padded(tiny_path):
    model = load_actor(tiny_path)
    model.set_attn_implementation("eager")
    reason = enable_packing(model)
    assert reason is not None and "'eager'" in reason and not packs(model)

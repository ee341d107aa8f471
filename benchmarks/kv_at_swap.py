"""What ``maker.kv_at_swap`` trades: a streaming maker's tokens per second against how far the
log-probs it samples with are from the exact ones, when weight pushes land mid-sequence.

    python benchmarks/kv_at_swap.py [--model smollm2-135m-instruct] [--prompts 64] [--slots 16]
                                    [--swap-every 8] [--step-size 1e-5] [--rounds 3] [--threads 2]

One ``ContinuousBatcher`` of ``--slots`` sequences generates ``--prompts`` arithmetic prompts
(half asking for the steps), each answer's length drawn from a lognormal (median 16 tokens,
sigma 1, at most 128) and no end token, so both settings generate the same number of tokens.
Every ``--swap-every`` decode steps a push lands: the weights flip between the model's own (A)
and A plus ``--step-size`` times a random sign on every weight (B, an Adam step of that learning
rate), with every running sequence inside it.

- ``keep`` goes on with the cache the old weights built;
- ``recompute`` prefills every running context again under the new weights.

Per setting: tokens per second (median of interleaved rounds, min-max), swaps, and the gap
between each token's sampled log-prob and its exact one, log pi_v(token | the whole context
encoded by pi_v) with v the version that sampled it (one forward pass of the finished sequence
under A and one under B): mean and max of |sampled - exact| over the tokens sampled after a
sequence's first swap. ``recompute``'s gap is float noise by construction; ``keep``'s is what
its speed costs in exactness.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # noqa: F401
from _common import median, publish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--swap-every", type=int, default=8)
    ap.add_argument("--step-size", type=float, default=1e-5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if _common.quick():
        args.model, args.prompts, args.rounds = "tiny", 16, 1

    import torch
    from continuous_batching import workload

    from ray_ppo.config import Config
    from ray_ppo.models import load_tokenizer
    from ray_ppo.models.build import build_actor, resolve_config, tokenizer_path

    torch.set_num_threads(args.threads)
    cfg = resolve_config(Config().with_overrides({
        "model.pretrained": args.model, "model.dtype": args.dtype, "maker.max_new_tokens": 128,
        "maker.temperature": 1.0, "data.max_prompt_len": 128}))
    actor = build_actor(cfg, with_lora=False).eval()
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    lengths_args = argparse.Namespace(prompts=args.prompts, cap=128, sigma=1.0, median=16, workload="lognormal")
    prompts, lengths = workload(lengths_args, tokenizer)
    weights_a = {k: v.clone() for k, v in actor.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weights_b = {k: v + args.step_size * torch.randint(0, 2, v.shape, generator=gen).to(v.dtype).mul(2).sub(1)
                 if v.is_floating_point() else v for k, v in weights_a.items()}
    settings = ["keep", "recompute"]
    runs = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in settings[r % 2:] + settings[:r % 2]:
            actor.load_state_dict(weights_a)
            torch.manual_seed(r)
            start = time.perf_counter()
            finished, swaps = generate(actor, cfg, tokenizer, prompts, lengths, args, setting, weights_a, weights_b)
            seconds = time.perf_counter() - start
            tokens = sum(len(f.tokens) for f in finished)
            gap = log_prob_gap(actor, cfg, finished, weights_a, weights_b)
            runs[setting].append((tokens / seconds, swaps, gap))
            print(f"round {r + 1} {setting}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s, "
                  f"{swaps} swaps, gap mean {gap[0]:.2e} max {gap[1]:.2e} over {gap[2]} tokens", flush=True)
    base = median([rate for rate, _, _ in runs["recompute"]])
    rows = []
    for setting, rs in runs.items():
        rates = [rate for rate, _, _ in rs]
        rows.append([setting, median(rates), min(rates), max(rates), median(rates) / base,
                     median([s for _, s, _ in rs]), statistics.fmean(g[0] for _, _, g in rs),
                     max(g[1] for _, _, g in rs), median([g[2] for _, _, g in rs])])
    publish("kv_at_swap", ["kv_at_swap", "tokens/s (median)", "tokens/s min", "tokens/s max", "x recompute", "swaps",
                           "|log-prob gap| mean", "|log-prob gap| max", "tokens after a swap"], rows, args=args,
            title=f"{args.model} ({args.dtype}, {args.threads} threads), {args.prompts} prompts, {args.slots} slots, "
                  f"a push every {args.swap_every} decode steps (weights +-{args.step_size:g}), {args.rounds} rounds")


def generate(actor, cfg, tokenizer, prompts, lengths, args, setting, weights_a, weights_b):
    """The prompts through one batcher with a swap every ``--swap-every`` steps; (finished, swaps)."""
    from ray_ppo.models.continuous import ContinuousBatcher, Request

    batcher = ContinuousBatcher(actor, cfg.maker, tokenizer.pad_token_id, [], max_running=args.slots,
                                kv_at_swap=setting)
    batcher.submit(Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths)))
    finished, swaps = [], 0
    while batcher.busy:
        finished += batcher.step()
        if batcher.steps % args.swap_every == 0 and batcher.rows:
            swaps += 1
            batcher.swap(lambda: actor.load_state_dict(weights_b if swaps % 2 else weights_a), version=swaps)
    actor.load_state_dict(weights_a)
    return finished, swaps


def log_prob_gap(actor, cfg, finished, weights_a, weights_b) -> tuple[float, float, int]:
    """Mean and max |sampled - exact| log-prob over the tokens sampled after a sequence's first
    swap, and their count; exact: the whole sequence under the weights of the token's version
    (even versions A, odd B)."""
    import torch

    from ray_ppo.models import action_log_probs

    gaps = []
    exact = {}
    with torch.no_grad():
        for parity, weights in ((0, weights_a), (1, weights_b)):
            actor.load_state_dict(weights)
            for i, f in enumerate(finished):
                if f.swaps:
                    sequence = torch.tensor([f.prompt + f.tokens])
                    exact[i, parity] = action_log_probs(actor, sequence, torch.ones_like(sequence), len(f.tokens),
                                                        cfg.maker.temperature)[0]
    actor.load_state_dict(weights_a)
    for i, f in enumerate(finished):
        if not f.swaps:
            continue
        first = f.versions[0]
        for t, (v, sampled) in enumerate(zip(f.versions, f.log_probs)):
            if v != first:
                gaps.append(abs(sampled - float(exact[i, v % 2][t])))
    return (statistics.fmean(gaps), max(gaps), len(gaps)) if gaps else (0.0, 0.0, 0)


if __name__ == "__main__":
    main()

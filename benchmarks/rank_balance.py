"""Rank balance: how evenly the coordinator's buffers split a step's tokens across trainer ranks,
dealt by free space (``topology.balance=count``) or by tokens (``tokens``, the default).

    python benchmarks/rank_balance.py [--steps 200] [--seeds 0 1 2]

With several ranks, every rank of a step waits for the slowest at the gradient all-reduce, and a
packed pass costs about its tokens, so a step lasts as long as its rank with the most tokens.
This drives the coordinator's own ``RankBuffers`` (no Ray, no model) with synthetic groups and
reports, per step, the most tokens any rank holds over the mean across ranks (1.0 = even; the
step's time over an even split's, if time is proportional to tokens, which is the assumption).

Groups: ``maker.samples_per_prompt`` 4, a prompt of 30-60 tokens shared by the group, each
answer lognormal around its group's own mean length (the group means lognormal, median 40
tokens), capped at 256: a long-tail workload where some prompts get long answers. They arrive a
group at a time, as streaming makers send them. Each rank's buffer holds two steps
(``topology.buffer_size`` 0), and a step is ``trainer.train_batch_size`` 32 items a rank.
Two regimes:
  trainer-bound  the makers keep the buffers full: arrivals are placed until one does not fit,
                 then every rank pulls a step (a step's groups are all in the buffers before any
                 rank takes them, so ``tokens`` deals each step again, longest group first)
  maker-bound    each rank's pull waits and takes its items as they arrive (so ``tokens`` can
                 only choose the rank of each arriving group)
Rows: the mean of the per-step ratio over ``--steps`` steps (what the steps' total time is
over an even split's), its range over seeds, and its median and 90th percentile (medians over
seeds).
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import _common  # noqa: F401  (sys.path)
from _common import publish, quick
from ray_ppo.algo import ExperienceItem
from ray_ppo.coordinator.state import RankBuffers
from ray_ppo.wire.transport import ExperienceChunk, resolve

GROUP = 4
STEP_ITEMS = 32


def group_items(rng: random.Random, uid: str) -> list[ExperienceItem]:
    """One prompt's ``GROUP`` answers, with the lengths the module doc describes."""
    prompt = torch.ones(rng.randint(30, 60), dtype=torch.long)
    mean = 40 * rng.lognormvariate(0, 0.8)
    out = []
    for i in range(GROUP):
        n = max(1, min(256, round(mean * rng.lognormvariate(0, 0.3))))
        out.append(ExperienceItem.filled(prompt, torch.ones(n, dtype=torch.long), reward=0.0, policy_version=0,
                                         uid=f"{uid}-{i}"))
    return out


def run(balance: str, ranks: int, regime: str, steps: int, seed: int) -> list[float]:
    """The per-step max-over-mean token ratio of ``steps`` steps."""
    rng = random.Random(seed)
    buffers = RankBuffers(ranks, 2 * STEP_ITEMS, STEP_ITEMS, balance)
    targets, ratios, waiting, made = list(range(ranks)), [], None, 0
    pulls: list[list[ExperienceChunk]] = [[] for _ in targets]
    while len(ratios) < steps:
        if waiting is None:
            waiting = ExperienceChunk.of(group_items(rng, str(made)), "inline", group_size=GROUP)
            buffers.accept(waiting.count)
            made += 1
        waiting = buffers.route(waiting, targets)
        placed = not waiting.count
        waiting = None if placed else waiting
        if regime == "maker-bound" or not placed:
            for r in targets:  # trainer-bound: only once arrivals stopped fitting
                have = sum(c.count for c in pulls[r])
                buffers.take(r, STEP_ITEMS - have, pulls[r])
        if all(sum(c.count for c in out) == STEP_ITEMS for out in pulls):
            tokens = [sum(it.prompt_ids.numel() + it.response_ids.numel() for it in resolve(out).items) for out in pulls]
            for _ in targets:
                buffers.commit(STEP_ITEMS)
            ratios.append(max(tokens) / statistics.mean(tokens))
            pulls = [[] for _ in targets]
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40 if quick() else 200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows = []
    for regime in ("trainer-bound", "maker-bound"):
        for ranks in (2, 4, 8):
            for balance in ("count", "tokens"):
                means, medians, p90s = [], [], []
                for seed in args.seeds:
                    ratios = sorted(run(balance, ranks, regime, args.steps, seed))
                    means.append(statistics.mean(ratios))
                    medians.append(statistics.median(ratios))
                    p90s.append(ratios[int(0.9 * (len(ratios) - 1))])
                rows.append([regime, ranks, balance, f"{statistics.median(means):.3f}",
                             f"{min(means):.3f}-{max(means):.3f}", f"{statistics.median(medians):.3f}",
                             f"{statistics.median(p90s):.3f}"])
    publish("rank_balance", ["regime", "ranks", "balance", "max/mean, mean", "(range over seeds)", "median", "p90"],
            rows, args=args,
            title=f"tokens of a step's busiest rank over the mean, {args.steps} steps, seeds {args.seeds}")


if __name__ == "__main__":
    main()

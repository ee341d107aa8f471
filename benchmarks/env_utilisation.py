"""Generation utilisation of a maker running multi-turn episodes with an environment that sleeps.

    python benchmarks/env_utilisation.py [--episodes 32] [--pipelines 1,2,4,8] [--sleep-ms 50,200]
                                         [--turns 3] [--turn-tokens 16] [--models 256x4,576x30] [--repeats 3]

One maker's episode loop as a run has it (``ray_ppo.makers.episodes.EpisodeRunner`` driving
``ExperienceMaker``'s real HF ``generate``, one torch thread, as ``maker.torch_threads: 1``) runs a
batch of ``--episodes`` episodes of ``--turns`` policy turns (up to ``--turn-tokens`` tokens each)
on GPT-2 models of each ``--models`` shape (width x layers) built here with the tiny tokenizer
(576 x 30 has SmolLM2-135M's width, depth and about its size). The environment
answers every turn with a short observation, either at once or after sleeping (``asyncio.sleep``,
as an environment awaiting I/O) a uniformly random time in ``--sleep-ms``.

utilisation = seconds inside ``generate`` / wall seconds of the batch of episodes; tokens/s
ratio = the policy's tokens per second with the sleeping environment / without (a generation call
for few episodes is busy but makes fewer tokens than a full one). The goal
(issue 42): with the sleeping environment, at least 0.9 of the utilisation without sleep, which
``env.pipeline`` groups decide: one group generates while the others' steps run. ``gen ms`` is
the median time of one batched generation call without sleep; a pipeline hides a step when the
other groups' calls take longer than it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from _common import median, publish, quick
from ray_ppo.env import Environment, Turn


class Answering(Environment):
    """``TURNS`` policy turns; every step answers with two digits, after sleeping ``SLEEP_S`` (a range)."""

    TURNS = 3
    SLEEP_S: tuple[float, float] | None = None

    def __init__(self, prompt):
        super().__init__(prompt)
        self.turn = 0

    async def step(self, response: str) -> Turn:
        if self.SLEEP_S is not None:
            await asyncio.sleep(random.uniform(*self.SLEEP_S))
        self.turn += 1
        return Turn(observation=" 4 2", reward=float(len(response) > 0), done=self.turn >= self.TURNS)


def build_maker(args, directory: str, width: int, layers: int):
    import torch

    from ray_ppo.config import Config
    from ray_ppo.makers.build import build_experience_maker
    from ray_ppo.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(directory, n_embd=width, n_layer=layers, n_head=4)
    cfg = Config.from_dict({"model": {"pretrained": str(path)}, "algo": {"advantage": "grpo"},
                            "maker": {"max_new_tokens": args.turn_tokens, "samples_per_prompt": 2}})
    return cfg, build_experience_maker(cfg)


def run_batch(maker, cfg, pipeline: int, sleep_s, prompts: list[str]):
    """(utilisation, wall s, median ms of one generation call, policy tokens / s) of one batch of episodes."""
    from ray_ppo.makers.episodes import EpisodeRunner

    Answering.SLEEP_S = sleep_s
    runner = EpisodeRunner(Answering, cfg.env.model_copy(update=dict(cls="benchmark:Answering", pipeline=pipeline,
                                                                     max_tokens=120)), maker.tokenizer)
    calls: list[float] = []

    def sample(contexts, max_new_tokens):
        start = time.perf_counter()
        out = maker._turns(contexts, max_new_tokens)
        calls.append(time.perf_counter() - start)
        return out

    ids = [maker.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    episodes = runner.run(ids, prompts, sample)
    runner.loop.call_soon_threadsafe(runner.loop.stop)
    tokens_per_s = int(episodes.rollout.action_mask.sum()) / episodes.wall_s
    return episodes.utilisation, episodes.wall_s, 1000 * statistics.median(calls), tokens_per_s


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--pipelines", default="1,2,4,8")
    p.add_argument("--sleep-ms", default="50,200")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--models", default="256x4,576x30", help="GPT-2 shapes, width x layers")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if quick():
        args.episodes, args.repeats, args.pipelines, args.models = 8, 1, "2", "256x4"
    Answering.TURNS = args.turns
    low, high = (float(x) / 1000 for x in args.sleep_ms.split(","))
    rng = random.Random(0)
    prompts = [" ".join(str(rng.randrange(10)) for _ in range(6)) for _ in range(args.episodes)]
    rows = []
    for model in args.models.split(","):
        width, layers = (int(x) for x in model.split("x"))
        with tempfile.TemporaryDirectory() as directory:
            cfg, maker = build_maker(args, directory, width, layers)
            run_batch(maker, cfg, 1, None, prompts[:4])  # warm-up: first generate call, thread pools
            for pipeline in (int(x) for x in args.pipelines.split(",")):
                rows.append([model, pipeline, args.episodes, *cell(args, maker, cfg, pipeline, (low, high), prompts)])
                print(rows[-1], flush=True)
    publish("env_utilisation", ["model", "env.pipeline", "episodes", "gen ms", "util no sleep", "util sleep", "ratio",
                                "ratio range", "tokens/s ratio", "wall s (sleep)"], rows, args,
            title=f"Generation utilisation, {args.turns}-turn episodes, steps sleeping {args.sleep_ms} ms, "
                  f"{args.turn_tokens} tokens a turn, 1 torch thread, median of {args.repeats} interleaved rounds")


def cell(args, maker, cfg, pipeline: int, sleep_s: tuple[float, float], prompts: list[str]) -> list:
    """gen ms, utilisation without and with sleep, their ratio (median, range), tokens/s ratio, wall s."""
    busy, sleeping, walls, gens, speed = [], [], [], [], []
    for _ in range(args.repeats):  # interleaved, so drift on the machine hits both alike
        u, _, gen_ms, fast = run_batch(maker, cfg, pipeline, None, prompts)
        busy.append(u)
        gens.append(gen_ms)
        u, wall, _, slow = run_batch(maker, cfg, pipeline, sleep_s, prompts)
        sleeping.append(u)
        walls.append(wall)
        speed.append(slow / fast)
    ratios = [s / b for s, b in zip(sleeping, busy, strict=True)]
    return [round(median(gens)), median(busy), median(sleeping), median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}",
            median(speed), median(walls)]


if __name__ == "__main__":
    main()

"""Stand-ins for the parts of a run that tests and benchmarks replace through ``PPOTrainer``'s
extension points (``experience_maker_factory``), never through a config flag; and
``coordinator_config``, the config of a coordinator driven on its own."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Sequence

import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.config import Config
from ray_ppo.data import prompt_text
from ray_ppo.env import Turn
from ray_ppo.makers.experience import MakeStats
from ray_ppo.tasks.turns import TwoTurnEnv


class WaitingExperienceMaker:
    """An ``ExperienceMaker`` whose rollout is a wait: the i-th batch (from 0) takes ``waits[i]``
    seconds, the last entry repeated for every batch after it, with the CPU free meanwhile (as a
    GPU kernel leaves it). Its actor and critic are the real models of ``cfg``, so weight pushes
    into it are real; its items have the toy task's shape (each prompt, ``response_len`` tokens
    of id 5, reward 0) and carry the version they were made at.

    Pass it as a factory with its waits bound: ``functools.partial(WaitingExperienceMaker,
    waits=(6.0, 0.0))`` makes a maker whose first batch takes 6 s and the rest none.
    """

    def __init__(self, cfg, name: str, device, waits: Sequence[float] = (0.0,), response_len: int = 8):
        from ray_ppo.models import load_tokenizer
        from ray_ppo.models.build import build_actor, build_critic, tokenizer_path

        if not waits or any(w < 0 for w in waits):
            raise ValueError(f"waits={tuple(waits)!r}: give at least one wait, none negative (seconds per batch)")
        self.actor, self.critic, self.ref, self.reward_model = build_actor(cfg), build_critic(cfg), None, None
        self.tokenizer = load_tokenizer(tokenizer_path(cfg))
        self.kl_coef = cfg.ppo.kl_coef  # set by weight pushes, as on a real maker
        self.name, self.waits, self.response_len, self.batches = name, tuple(waits), response_len, 0

    def make_experience(self, prompt_ids: list[list[int]], policy_version: int, kl_coef: float | None = None,
                        prompts: Sequence | None = None):
        start = time.perf_counter()
        time.sleep(self.waits[min(self.batches, len(self.waits) - 1)])
        waited = time.perf_counter() - start
        self.batches += 1
        items = [ExperienceItem.filled(torch.tensor(ids), torch.full((self.response_len,), 5), reward=0.0,
                                       policy_version=policy_version, uid=f"{self.name}-{self.batches}-{i}",
                                       prompt=None if prompts is None else prompts[i])
                 for i, ids in enumerate(prompt_ids)]
        return items, MakeStats(num_samples=len(items), num_tokens=self.response_len * len(items), generate_s=waited)


class SleepyEnv(TwoTurnEnv):
    """``ray_ppo.tasks.turns.TwoTurnEnv`` whose every step first sleeps (``asyncio.sleep``, as an
    environment awaiting I/O) a uniformly random ``sleep_s`` range: 50-200 ms."""

    sleep_s: tuple[float, float] = (0.05, 0.2)

    async def step(self, response: str) -> Turn:
        await asyncio.sleep(random.uniform(*self.sleep_s))
        return await super().step(response)


class FaultyEnv(SleepyEnv):
    """``SleepyEnv``, except on prompts whose first digit is 0 (the step raises), 1 (it hangs for an
    hour) or 2 (it returns a string, not a ``Turn``): the three faults an episode must survive."""

    async def step(self, response: str):
        first = prompt_text(self.prompt).split()[0]
        if first == "0":
            raise RuntimeError("the environment broke")
        if first == "1":
            await asyncio.sleep(3600)
        if first == "2":
            return "garbage"
        return await super().step(response)


def coordinator_config(num_ranks: int = 1, num_makers: int = 1, buffer_size: int = 16, max_staleness: int = 1,
                       items_per_version: int = 8, routing: str = "round_robin", prompt_batch_size: int = 16,
                       samples_per_prompt: int = 1, shuffle: bool = True, seed: int = 0) -> Config:
    """A config whose coordinator (``CoordinatorState.of_config``) has these quantities:
    ``trainer.num_workers`` ranks training ``items_per_version`` items per version between them
    (``trainer.update_steps`` 1), ``maker.num_makers`` makers of ``maker.batch_size`` prompts, and
    so on. Not validated: tests and benchmarks drive a coordinator with buffers smaller than a
    batch, or budgets no run has, which a run's config refuses."""
    if items_per_version % num_ranks:
        raise ValueError(f"items_per_version={items_per_version} is not a multiple of num_ranks={num_ranks}")
    cfg = Config()
    batch = items_per_version // num_ranks
    sections = {
        "trainer": {"num_workers": num_ranks, "update_steps": 1, "train_batch_size": batch, "mini_batch_size": batch},
        "maker": {"num_makers": num_makers, "batch_size": prompt_batch_size, "samples_per_prompt": samples_per_prompt},
        "ppo": {"max_staleness": max_staleness},
        "topology": {"routing": routing, "buffer_size": buffer_size},
        "data": {"shuffle": shuffle},
    }
    return cfg.model_copy(update={"seed": seed, **{name: getattr(cfg, name).model_copy(update=fields)
                                                   for name, fields in sections.items()}})

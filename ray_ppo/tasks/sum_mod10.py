"""A task that needs computing, not copying: answer with the sum of two digits modulo 10.

A prompt is two space-separated digits (``"3 8"``); the answer is ``(3 + 8) % 10 = 1``. The rule
reward scores a response by how many of its first ``TARGET_LEN`` tokens equal the answer, divided
by ``TARGET_LEN`` (a response that stops early cannot score full marks), so it lies in [0, 1] and
a uniformly random tiny model scores about 1/13. Unlike the toy task (repeat the last digit: one
attention head copying a token), the answer is never in the prompt: the policy must combine both
digits through a 10 x 10 table, which takes the tiny model a few hundred PPO steps rather than a
few dozen. ``ray-ppo toy-data DIR --task sum_mod10`` writes the prompt files; ``configs/sum_mod10.yaml``
trains on them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

from ray_ppo.data import Prompt, prompt_text
from ray_ppo.tasks.toy import write_prompts

TARGET_LEN = 4
"""Number of response tokens that count towards the reward."""


def answer(prompt: str) -> str | None:
    """The expected digit for a prompt of two digits, or None if the prompt is not two digits."""
    words = prompt.split()
    if len(words) != 2 or not all(w.isdigit() and len(w) == 1 for w in words):
        return None
    return str((int(words[0]) + int(words[1])) % 10)


def reward(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """Rule reward (signature of every ``model.reward_fn``): the share of the first ``TARGET_LEN``
    response tokens equal to (a + b) mod 10; 0 for a prompt that is not two digits. A prompt is a
    text or a list of chat messages, whose last message's content is the text read; a response is
    decoded text."""
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        target = answer(prompt_text(prompt))
        hits = sum(token == target for token in response.split()[:TARGET_LEN]) if target is not None else 0
        scores.append(hits / TARGET_LEN)
    return scores


def make_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Random two-digit prompts (every one of the 100 pairs equally likely), deterministic for a seed."""
    rng = random.Random(seed)
    return [f"{rng.randrange(10)} {rng.randrange(10)}" for _ in range(num_prompts)]


def write_prompt_files(directory: str | Path, num_prompts: int = 512, seed: int = 0) -> tuple[Path, Path]:
    """Write ``sum_mod10_prompts.csv`` and ``.parquet`` (column ``prompt``) to ``directory``."""
    return write_prompts(directory, "sum_mod10_prompts", make_prompts(num_prompts, seed))

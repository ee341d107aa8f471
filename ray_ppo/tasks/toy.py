"""The toy task: answer with the prompt's last digit, repeated.

A prompt is a few space-separated digits (``"3 1 4 1 5"``). The rule reward scores a response
by how many of its first ``TARGET_LEN`` tokens equal the prompt's last digit, divided by
``TARGET_LEN``; so it lies in [0, 1], a uniformly random tiny model scores about 1/13, and a
response that stops early (EOS) cannot score full marks. The policy has to read the prompt,
which makes the reward verifiable and prompt-dependent, yet a 2-layer model learns it in a few
minutes of PPO on two CPU cores.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Sequence

from ray_ppo.data import Prompt, prompt_text

TARGET_LEN = 8
"""Number of response tokens that count towards the reward."""


def reward(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """Rule reward of the toy task (signature of every ``model.reward_fn``).

    Args:
        prompts: each response's prompt as the data gave it: a text, or a list of chat messages
            (``ray_ppo.data.Prompt``), whose last message's content is the text read.
        responses: decoded responses, special tokens removed.

    Returns:
        One float per response: the share of the first ``TARGET_LEN`` response tokens that
        equal the prompt's last whitespace-separated token.
    """
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        words = prompt_text(prompt).split()
        target = words[-1] if words else None
        hits = sum(token == target for token in response.split()[:TARGET_LEN])
        scores.append(hits / TARGET_LEN)
    return scores


def make_prompts(num_prompts: int, prompt_len: int, seed: int = 0) -> list[str]:
    """Random digit prompts, deterministic for a given seed."""
    rng = random.Random(seed)
    return [" ".join(str(rng.randrange(10)) for _ in range(prompt_len)) for _ in range(num_prompts)]


def write_prompt_files(directory: str | Path, num_prompts: int = 512, prompt_len: int = 6, seed: int = 0) -> tuple[Path, Path]:
    """Write ``toy_prompts.csv`` and ``toy_prompts.parquet`` (column ``prompt``) to ``directory``."""
    return write_prompts(directory, "toy_prompts", make_prompts(num_prompts, prompt_len, seed))


def write_prompts(directory: str | Path, stem: str, prompts: list[str]) -> tuple[Path, Path]:
    """Write ``prompts`` to ``directory/stem.csv`` and ``directory/stem.parquet`` (column ``prompt``)."""
    import pandas as pd

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    csv_path, parquet_path = directory / f"{stem}.csv", directory / f"{stem}.parquet"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt"])
        writer.writerows([p] for p in prompts)
    pd.DataFrame({"prompt": prompts}).to_parquet(parquet_path, index=False)
    return csv_path, parquet_path

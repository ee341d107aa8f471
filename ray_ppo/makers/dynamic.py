"""DAPO's dynamic sampling (``algo.dynamic_sampling``): a group whose rewards are all equal has zero
advantages under a group baseline (GRPO, RLOO), so training on it spends a step's room on nothing.
A maker drops such groups before sending; their prompts are reported as consumed
(``MakerStats.dropped_ids``; the prompt ledger counts them ``dropped``, done), and the coordinator
serves the maker more prompts, so the trainer's batches fill with groups that carry a signal.

The cap (``algo.dynamic_sampling_max_draws`` = D): after D - 1 uniform groups dropped in a row the
maker keeps the next one, so at most D prompts are drawn per group sent, and a run whose groups all
agree (a task solved, or hopeless) still trains and ends.

    keep = GroupFilter.of_config(cfg)        # None when algo.dynamic_sampling is off
    items, dropped_ids = keep(items)         # items: whole groups, each group's items next to each other
"""

from __future__ import annotations

from typing import Sequence

from ray_ppo.algo import ExperienceItem
from ray_ppo.config import Config


class GroupFilter:
    """Drops the uniform groups of a maker's items, within the cap; counts what it dropped."""

    def __init__(self, group_size: int, max_draws: int):
        if group_size < 2 or max_draws < 1:
            raise ValueError(f"group_size={group_size} (>= 2) and max_draws={max_draws} (>= 1)")
        self.group_size, self.max_draws = group_size, max_draws
        self.in_a_row = 0  # uniform groups dropped since the last group kept
        self.dropped = self.kept = 0

    @classmethod
    def of_config(cls, cfg: Config) -> GroupFilter | None:
        a = cfg.algo
        return cls(cfg.maker.samples_per_prompt, a.dynamic_sampling_max_draws) if a.dynamic_sampling else None

    def __call__(self, items: Sequence[ExperienceItem]) -> tuple[list[ExperienceItem], list[int]]:
        """(the items of the groups kept, the prompt ids of the groups dropped), in order."""
        if len(items) % self.group_size:
            raise ValueError(f"{len(items)} items do not make whole groups of {self.group_size}")
        kept, dropped = [], []
        for start in range(0, len(items), self.group_size):
            group = items[start:start + self.group_size]
            rewards = [float(it.reward) for it in group]
            if max(rewards) == min(rewards) and self.in_a_row < self.max_draws - 1:
                self.in_a_row += 1
                self.dropped += 1
                dropped.append(int(group[0].prompt_id))
            else:
                self.in_a_row = 0
                self.kept += 1
                kept += group
        return kept, dropped

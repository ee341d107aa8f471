"""DAPO's dynamic sampling at the maker (``ray_ppo.makers.dynamic.GroupFilter``): uniform groups
dropped within the cap, their prompt ids reported; and the settings' checks."""

from __future__ import annotations

import pytest

from ray_ppo.algo import ExperienceItem
from ray_ppo.config import Config, ConfigError
from ray_ppo.makers.dynamic import GroupFilter


def groups(*rewards: tuple[float, ...]) -> list[ExperienceItem]:
    """Items of groups with these rewards, prompt ids 10, 11, ..."""
    items = []
    for g, group in enumerate(rewards):
        for r in group:
            item = ExperienceItem.__new__(ExperienceItem)
            item.reward, item.prompt_id = r, 10 + g
            items.append(item)
    return items


def test_uniform_groups_are_dropped_and_their_prompts_named():
    keep = GroupFilter(group_size=2, max_draws=10)
    kept, dropped = keep(groups((1, 1), (0, 1), (0, 0), (0.5, 0.25)))
    assert [it.prompt_id for it in kept] == [11, 11, 13, 13] and dropped == [10, 12]
    assert (keep.dropped, keep.kept) == (2, 2)


def test_after_max_draws_less_one_dropped_in_a_row_the_next_uniform_group_is_kept():
    keep = GroupFilter(group_size=2, max_draws=3)
    kept, dropped = keep(groups((1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (0, 1)))
    assert dropped == [10, 11, 13, 14] and [it.prompt_id for it in kept] == [12, 12, 15, 15, 16, 16]
    kept, dropped = keep(groups((0, 0)))  # the count goes on across calls: one dropped in a row so far
    assert dropped == [10] and keep.in_a_row == 1
    assert GroupFilter(2, max_draws=1)(groups((1, 1)))[1] == []  # max_draws 1: nothing is ever dropped


def test_the_filter_takes_whole_groups():
    with pytest.raises(ValueError, match="whole groups of 2"):
        GroupFilter(2, 3)(groups((1, 1))[:1])


def test_dynamic_sampling_needs_groups_under_a_group_baseline():
    on = {"algo.dynamic_sampling": True}
    assert GroupFilter.of_config(Config().with_overrides({"algo.advantage": "grpo", "maker.samples_per_prompt": 4})) is None
    cfg = Config().with_overrides({**on, "algo.advantage": "rloo", "maker.samples_per_prompt": 4,
                                   "algo.dynamic_sampling_max_draws": 5})
    keep = GroupFilter.of_config(cfg)
    assert (keep.group_size, keep.max_draws) == (4, 5)
    for bad in ({"algo.advantage": "gae", "maker.samples_per_prompt": 4},
                {"algo.advantage": "reinforce_pp", "maker.samples_per_prompt": 1}):
        with pytest.raises(ConfigError, match="algo.dynamic_sampling drops the groups") as refused:
            Config().with_overrides({**on, **bad})
        assert "\n" not in str(refused.value)

"""A rule reward for tests that records what it is given (``model.reward_fn=chat_rewards:record``)."""

from __future__ import annotations

calls: list[tuple[list, list]] = []
"""(prompts, responses) of every call, in order."""


def record(prompts, responses) -> list[float]:
    calls.append((list(prompts), list(responses)))
    return [0.0] * len(responses)

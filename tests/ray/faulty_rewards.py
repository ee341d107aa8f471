"""Reward functions that pass pre-flight's probe (an empty response and the prompt itself as a
response) but fail on what the policy really writes, so the fault happens inside a maker."""

import math


def nan_on_generated(prompts, responses):
    """0.0 on the probe; NaN for a generated response (anything but empty or the prompt itself)."""
    return [0.0 if not r or r == p else math.nan for p, r in zip(prompts, responses)]


def raise_on_generated(prompts, responses):
    """0.0 on the probe; a generated response is looked up in a table that does not hold it (KeyError)."""
    table = {}
    return [0.0 if not r or r == p else table[r] for p, r in zip(prompts, responses)]


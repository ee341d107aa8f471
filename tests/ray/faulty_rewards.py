"""A reward function that passes pre-flight's probe (an empty response and the prompt itself as a
response) but fails on what the policy really writes, so the fault happens inside a maker."""

import math


def nan_on_generated(prompts, responses):
    """0.0 on the probe; NaN for a generated response (anything but empty or the prompt itself)."""
    return [0.0 if not r or r == p else math.nan for p, r in zip(prompts, responses)]


"""Rules that both the config's checks and the runtime apply, in a module that imports nothing:
the coordinator's process loads it without the config's schema (pydantic, ~0.1 s of imports)."""

from __future__ import annotations


def staleness_budget(max_staleness: int, items_per_version: int, lag: int = 0) -> int:
    """The admission rule's budget: items made at a maker version ``lag`` versions behind the
    trainer's stay usable for ``max_staleness - lag + 1`` more versions, so the trainer consumes at
    most that many versions' worth of them (``items_per_version`` each). The config check
    (``ray_ppo.config``) and the coordinator's admission
    (``ray_ppo.coordinator.state.Admission``) both use it."""
    return (max_staleness - lag + 1) * items_per_version

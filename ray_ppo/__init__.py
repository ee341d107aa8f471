"""ray_ppo: detached PPO for language models on Ray.

Importing the package is cheap: it pulls in neither Ray nor torch. ``PPOTrainer``, ``Config``
and ``load_config`` are loaded on first use::

    from ray_ppo import PPOTrainer, load_config

The code is laid out by role (docs/design.md has the map). Module paths from before that layout
(2026-12-06) still import, as the same module objects (``_MOVED``).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_LAZY = {"PPOTrainer": "ray_ppo.api", "Config": "ray_ppo.config", "load_config": "ray_ppo.config"}
__all__ = sorted(_LAZY)

_MOVED = {
    "ray_ppo.async_search": "ray_ppo.cluster.async_search",
    "ray_ppo.choices": "ray_ppo.config.choices",
    "ray_ppo.config_doc": "ray_ppo.config.reference",
    "ray_ppo.config_errors": "ray_ppo.config.errors",
    "ray_ppo.core.algo": "ray_ppo.algo",
    "ray_ppo.core.build": "ray_ppo.models.build",
    "ray_ppo.core.checkpoint": "ray_ppo.train.checkpoint",
    "ray_ppo.core.collectives": "ray_ppo.train.collectives",
    "ray_ppo.core.colossalai_strategy": "ray_ppo.train.colossalai_strategy",
    "ray_ppo.core.episodes": "ray_ppo.makers.episodes",
    "ray_ppo.core.experience": "ray_ppo.makers.experience",
    "ray_ppo.core.learner": "ray_ppo.train.learner",
    "ray_ppo.core.metrics": "ray_ppo.algo.metrics",
    "ray_ppo.core.models": "ray_ppo.models",
    "ray_ppo.core.packed": "ray_ppo.wire.packed",
    "ray_ppo.core.seeds": "ray_ppo.data.seeds",
    "ray_ppo.core.strategies": "ray_ppo.train.strategies",
    "ray_ppo.core.sync": "ray_ppo.models.sync",
    "ray_ppo.core.vllm_engine": "ray_ppo.makers.vllm_engine",
    "ray_ppo.eval_records": "ray_ppo.outputs.evals",
    "ray_ppo.evaluate": "ray_ppo.makers.evaluation",
    "ray_ppo.failures": "ray_ppo.outputs.failures",
    "ray_ppo.jsonl": "ray_ppo.outputs.jsonl",
    "ray_ppo.plots": "ray_ppo.outputs.plots",
    "ray_ppo.preflight": "ray_ppo.config.preflight",
    "ray_ppo.ray_private": "ray_ppo.cluster.ray_private",
    "ray_ppo.readiness": "ray_ppo.cluster.readiness",
    "ray_ppo.resources": "ray_ppo.config.resources",
    "ray_ppo.rules": "ray_ppo.config.rules",
    "ray_ppo.rundir": "ray_ppo.outputs.rundir",
    "ray_ppo.runtime.coordinator": "ray_ppo.coordinator.actor",
    "ray_ppo.runtime.coordinator_state": "ray_ppo.coordinator.state",
    "ray_ppo.runtime.device_checks": "ray_ppo.makers.device_checks",
    "ray_ppo.runtime.feed": "ray_ppo.coordinator.feed",
    "ray_ppo.runtime.ledger": "ray_ppo.coordinator.ledger",
    "ray_ppo.runtime.loop": "ray_ppo.train.loop",
    "ray_ppo.runtime.maker": "ray_ppo.makers.worker",
    "ray_ppo.runtime.messages": "ray_ppo.wire.messages",
    "ray_ppo.runtime.monitor": "ray_ppo.train.monitor",
    "ray_ppo.runtime.publish": "ray_ppo.train.publish",
    "ray_ppo.runtime.receiver": "ray_ppo.makers.receiver",
    "ray_ppo.runtime.routing": "ray_ppo.coordinator.routing",
    "ray_ppo.runtime.transport": "ray_ppo.wire.transport",
    "ray_ppo.samples": "ray_ppo.outputs.samples",
    "ray_ppo.startup": "ray_ppo.cluster.startup",
    "ray_ppo.sweep": "ray_ppo.cluster.sweep",
    "ray_ppo.testing": "ray_ppo.makers.testing",
    "ray_ppo.tracking": "ray_ppo.outputs.tracking",
}
"""Old module path -> where it lives now. ``ray_ppo.outputs`` and ``ray_ppo.cluster`` name the new
packages, so their old modules are found only at ``ray_ppo.outputs.writers`` and
``ray_ppo.cluster.local_cluster``."""
_OLD_PACKAGES_MOVED = ("ray_ppo.core.algo", "ray_ppo.core.models")
"""Old packages moved whole: their modules move with them."""
_OLD_PACKAGES = ("ray_ppo.core", "ray_ppo.runtime")
"""Old packages whose modules went to several new ones: each imports as an empty package."""


def _moved_to(name: str) -> str | None:
    if name in _MOVED:
        return _MOVED[name]
    package, _, module = name.rpartition(".")
    return f"{_MOVED[package]}.{module}" if package in _OLD_PACKAGES_MOVED else None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module that now lives at the new one (one object, two names)."""

    def find_spec(self, name, path=None, target=None):
        if name in _OLD_PACKAGES:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        new = _moved_to(name) if name.startswith("ray_ppo.") else None
        return importlib.util.spec_from_loader(name, self) if new else None

    def create_module(self, spec):
        if spec.name in _OLD_PACKAGES:
            return None  # an empty package: its modules are found one by one in _MOVED
        return importlib.import_module(_moved_to(spec.name))

    def exec_module(self, module):
        pass  # the module ran when it was imported under its own name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finder, which would load a second copy


def __getattr__(name: str):
    if name == "__version__":  # the installed distribution's, as `ray-ppo --version` prints it
        from importlib.metadata import version

        return version("ray_ppo")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_ppo' has no attribute {name!r}")

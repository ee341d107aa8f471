"""ray_ppo: detached PPO for language models on Ray.

Importing the package is cheap: it pulls in neither Ray nor torch. ``PPOTrainer``, ``Config``
and ``load_config`` are loaded on first use::

    from ray_ppo import PPOTrainer, load_config
"""

import importlib

_LAZY = {"PPOTrainer": "ray_ppo.api", "Config": "ray_ppo.config", "load_config": "ray_ppo.config"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name == "__version__":  # the installed distribution's, as `ray-ppo --version` prints it
        from importlib.metadata import version

        return version("ray_ppo")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_ppo' has no attribute {name!r}")

"""A run's configuration: the schema (``schema``), its one-line errors (``errors``), the generated
reference (``reference``), the choice names (``choices``) and shared rules (``rules``), and the
checks run before any actor starts (``preflight``, ``resources``).

``from ray_ppo.config import Config, load_config`` loads the schema on first use, so ``choices``
and ``rules`` import without pydantic (the coordinator's process needs only them).
"""

import importlib


def __getattr__(name: str):
    schema = importlib.import_module("ray_ppo.config.schema")
    try:
        return getattr(schema, name)
    except AttributeError:
        raise AttributeError(f"module 'ray_ppo.config' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(importlib.import_module("ray_ppo.config.schema").__all__)

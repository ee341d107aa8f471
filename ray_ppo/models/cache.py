"""Where built and converted models live, and how each is written once: a leaf module, so the
tiny-model builder (``tiny``) and the GGUF converter (``gguf``) share it without importing each other."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """Where built models live: ``$RAY_PPO_CACHE`` or ``~/.cache/ray_ppo``."""
    return Path(os.environ.get("RAY_PPO_CACHE", Path.home() / ".cache" / "ray_ppo")).expanduser().resolve()


def build_once(target: Path, build) -> Path:
    """``target``, a model directory, written by ``build(directory)`` on first use: into a temporary
    sibling that is renamed into place, so concurrent processes never see a half-written model."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is complete
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

"""``ray-ppo config``: every config key with its value and its one-line doc.

    logging.samples_every = 10   (default)
        Every this many steps, write a few prompt/response/reward samples to samples.jsonl ...

Sections print as headers with their doc; a value that differs from the default says so.
"""

from __future__ import annotations

from ray_ppo.config import Config, _fmt, _is_section, _schema, dotted_field_docs


def describe_config(cfg: Config) -> str:
    """Every section and key of ``cfg`` in tree order: ``key = value  (default | default: X)`` and its doc."""
    defaults = Config()
    lines: list[str] = []
    for dotted, doc in dotted_field_docs(Config).items():
        if _is_section(_schema()[dotted]):
            lines += ["", f"[{dotted}]  {doc}"]
            continue
        value, default = cfg.get(dotted), defaults.get(dotted)
        note = "default" if value == default else f"default: {_fmt(default)}"
        lines += [f"{dotted} = {_fmt(value)}   ({note})", f"    {doc}"]
    return "\n".join(lines).lstrip("\n")

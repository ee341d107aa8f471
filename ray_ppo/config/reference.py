"""The config's own documentation: ``ray-ppo config`` and the docs site's configuration reference.

    logging.samples_every = 10   (default)
        Every this many steps, write a few prompt/response/reward samples to samples.jsonl ...

``describe_config`` prints sections as headers with their doc; a value that differs from the
default says so. ``reference_markdown`` renders the same tree as Markdown tables (key, type,
default, allowed values, doc), read from the pydantic fields, so the reference cannot drift from
the code: the docs build calls it (``scripts/docs_hooks.py``).
"""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic.fields import FieldInfo

from ray_ppo.config import _PATTERN_MUSTS, Config, _schema, dotted_field_docs
from ray_ppo.config.errors import choices, command_line, interval, is_section, unwrap, walk

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "string"}


def describe_config(cfg: Config) -> str:
    """Every section and key of ``cfg`` in tree order: ``key = value  (default | default: X)`` and its doc."""
    defaults = Config()
    lines: list[str] = []
    for dotted, doc in dotted_field_docs(Config).items():
        if is_section(_schema()[dotted]):
            lines += ["", f"[{dotted}]  {doc}"]
            continue
        value, default = cfg.get(dotted), defaults.get(dotted)
        note = "default" if value == default else f"default: {command_line(default)}"
        lines += [f"{dotted} = {command_line(value)}   ({note})", f"    {doc}"]
    return "\n".join(lines).lstrip("\n")


def reference_markdown() -> str:
    """Every key of ``Config`` as Markdown: the top-level keys, then one table per section (nested
    sections, e.g. ``maker.vllm``, get tables of their own), each row the key, its type, default,
    allowed values and docstring."""
    tables: dict[str, list[str]] = {"": []}
    intros: dict[str, str] = {"": "Keys at the top level of the config."}
    for dotted, _, _, info in walk(Config):
        parent = dotted.rpartition(".")[0]
        if is_section(info.annotation):
            tables[dotted] = []
            intros[dotted] = info.annotation.__doc__ or info.description or ""
            continue
        tables[parent].append(_row(dotted, info))
    out: list[str] = []
    for section, rows in tables.items():
        title = f"`{section}`" if section else "Top level"
        out += [f"## {title}", "", _escape(intros[section].strip()), "",
                "| key | type | default | allowed | description |", "|---|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def _row(dotted: str, info: FieldInfo) -> str:
    default = info.get_default(call_default_factory=True)
    cells = [f"`{dotted}`", _type_name(info.annotation), f"`{command_line(default)}`", _allowed(info),
             info.description or ""]
    return "| " + " | ".join(_escape(c) for c in cells) + " |"


def _type_name(hint: Any) -> str:
    """``int``, ``float or null``, ``list of string``, ``choice`` (a Literal; its names are in "allowed")."""
    base, optional = unwrap(hint)
    if _literal(hint):
        name = "choice"
    elif get_origin(base) is list:
        name = f"list of {_name(unwrap(get_args(base)[0])[0])}"
    else:
        name = _name(base)
    return f"{name} or null" if optional else name


def _name(base: Any) -> str:
    return _TYPE_NAMES.get(base) or getattr(base, "__name__", str(base))


def _literal(hint: Any) -> bool:
    try:
        choices(hint)
    except (StopIteration, IndexError):
        return False
    return True


def _allowed(info: FieldInfo) -> str:
    """The field's declared choices, bounds, pattern or length, as a "must be ..." error states them."""
    parts = []
    if _literal(info.annotation):
        parts.append(", ".join(f"`{c}`" for c in choices(info.annotation)))
    elif unwrap(info.annotation)[0] is bool:
        parts.append("`true`, `false`")
    bounds = {name: getattr(m, name) for m in info.metadata for name in ("gt", "ge", "lt", "le") if hasattr(m, name)}
    if bounds:
        parts.append(interval(bounds))
    for meta in [*info.metadata, *_annotated_metadata(info.annotation)]:
        pattern = getattr(meta, "pattern", None)
        if pattern in _PATTERN_MUSTS:
            parts.append(_PATTERN_MUSTS[pattern])
        if getattr(meta, "min_length", None):
            parts.append("a non-empty list")
    null = (info.json_schema_extra or {}).get("null") if isinstance(info.json_schema_extra, dict) else None
    if null:
        parts.append(f"null {null}")
    return "; ".join(dict.fromkeys(parts)) or "any"


def _annotated_metadata(hint: Any) -> list[Any]:
    """Constraints inside an ``Annotated`` type (``Text``, list items), which pydantic does not copy
    into the field's own metadata."""
    found = []
    for arg in get_args(hint):
        found += list(getattr(arg, "__metadata__", ())) + _annotated_metadata(arg)
    return found


def _escape(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")

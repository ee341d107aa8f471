"""A config's mistakes as one-line ``ConfigError`` messages: the dotted key, the bad value and the
fix (pydantic's validation errors, unknown keys with a did-you-mean, a value where a section goes).

``ErrorRenderer`` works over any tree of pydantic models; ``ray_ppo.config`` builds the one for
``Config``. This module imports only the standard library and pydantic, and nothing of ray_ppo.
"""

from __future__ import annotations

import difflib
import functools
import re
import types
from typing import Annotated, Any, Iterator, Literal, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """An invalid config. The message is one line: the field, the bad value and the fix."""

    def __init__(self, message: str):
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)))


def is_section(hint: Any) -> bool:
    """A nested settings model (a section), as opposed to a setting."""
    return isinstance(hint, type) and issubclass(hint, BaseModel)


def walk(cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], str, FieldInfo]]:
    """(dotted name, owning class, field name, field) of every field and section below ``cls``."""
    for name, info in cls.model_fields.items():
        yield prefix + name, cls, name, info
        if is_section(info.annotation):
            yield from walk(info.annotation, f"{prefix}{name}.")


class ErrorRenderer:
    """Responsibilities: know the schema below ``root`` (every dotted key and its type, and where
    each section class sits), and turn a bad key or a validation error into a ``ConfigError``.
    ``pattern_musts`` says what each field ``pattern`` means ("must be <this>"); ``base`` is the
    sections' common class, which names no section."""

    def __init__(self, root: type[BaseModel], pattern_musts: Mapping[str, str], base: type[BaseModel] = BaseModel):
        self.root, self.pattern_musts, self.base = root, pattern_musts, base  # base: the sections' common class

    @functools.cached_property
    def schema(self) -> dict[str, Any]:
        """Dotted name -> type of every field and section below the root."""
        return {dotted: info.annotation for dotted, _, _, info in walk(self.root)}

    @functools.cached_property
    def prefixes(self) -> dict[type, str]:
        """Section class (and each section base class, e.g. SamplingParams) -> its dotted name."""
        prefixes: dict[type, str] = {self.root: ""}
        for dotted, hint in self.schema.items():
            for cls in hint.__mro__ if is_section(hint) else ():
                if is_section(cls) and cls not in (self.base, BaseModel):
                    prefixes.setdefault(cls, dotted)
        return prefixes

    def hint_of(self, dotted: str) -> Any:
        """Type of the field ``dotted``, or a ConfigError with a did-you-mean."""
        hint = self.schema.get(dotted)
        if hint is None:
            raise self.unknown_key(dotted)
        return hint

    def unknown_key(self, dotted: Any) -> ConfigError:
        dotted = str(dotted)
        parts = dotted.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
        for ancestor in sorted(ancestors, key=len):
            if ancestor in self.schema and not is_section(self.schema[ancestor]):
                return ConfigError(f"unknown key {dotted!r}: {ancestor} is a setting, not a section")
        names = [n for n in self.schema if n not in ancestors]
        parent = dotted.rpartition(".")[0]
        siblings = [n for n in names if n.rpartition(".")[0] == parent]
        match = difflib.get_close_matches(dotted, siblings, n=1) or difflib.get_close_matches(dotted, names, n=1)
        if match:
            return ConfigError(f"unknown key {dotted!r}; did you mean {match[0]!r}?")
        if not siblings:
            parent, siblings = "", [n for n in names if "." not in n]
        where = f"under {parent}" if parent else "at the top level"
        valid = ", ".join(n.rpartition(".")[2] for n in siblings)
        return ConfigError(f"unknown key {dotted!r}; valid keys {where}: {valid}")

    def error(self, exc: ValidationError, cls: type[BaseModel]) -> ConfigError:
        """The first of pydantic's errors (validating section ``cls``) as a ConfigError naming the
        dotted key, the value and the fix."""
        error = exc.errors()[0]
        kind, value = error["type"], error["input"]
        if isinstance(error.get("ctx", {}).get("error"), ConfigError):
            return error["ctx"]["error"]  # a model validator's own message
        key, shown, info, item = self._locate(cls, error["loc"])
        if kind == "extra_forbidden":
            return self.unknown_key(key)
        if kind.endswith("_type") or (kind == "literal_error" and not isinstance(value, str)):
            return ConfigError(f"{shown or 'the config'}: expected {_describe(info.annotation, item)}, got {shown_value(value)}")
        if unwrap(info.annotation)[0] is float and type(value) is int:
            value = float(value)
        return ConfigError(f"{shown}={value!r} is invalid: must be {self._must(error, info)}; {_fix(key, info)}")

    def _locate(self, cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, str, FieldInfo | None, bool]:
        """(dotted key, the key as shown with list indices, its field (None if unknown), whether
        ``loc`` ends at a list item)."""
        key = shown = self.prefixes.get(cls, "")
        info, item, section = None, False, cls
        for part in loc:
            if isinstance(part, int):
                shown, item = f"{shown}[{part}]", True
                continue
            key = shown = f"{key}.{part}" if key else str(part)
            info = section.model_fields.get(part) if is_section(section) else None
            section = info.annotation if info else None
        return key, shown, info, item

    def _must(self, error: Mapping[str, Any], info: FieldInfo) -> str:
        """Completes "must be ...": the field's declared bounds, choices or pattern."""
        kind = error["type"]
        if kind == "literal_error":
            return "one of " + ", ".join(choices(info.annotation))
        if kind == "string_pattern_mismatch":
            return self.pattern_musts[error["ctx"]["pattern"]]
        if kind == "too_short":
            return "a non-empty list"
        bounds = {name: getattr(m, name) for m in info.metadata for name in ("gt", "ge", "lt", "le") if hasattr(m, name)}
        return interval(bounds) if bounds else error["msg"]


def not_a_mapping(dotted: str, value: Any) -> ConfigError:
    return ConfigError(f"{dotted or 'the config'}: expected a mapping of settings (key: value), got {shown_value(value)}")


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(base type, optional) of a field type: Optional and Annotated removed, a Literal of names -> str."""
    optional = False
    while True:
        origin = get_origin(hint)
        if origin in (Union, types.UnionType):
            hint, optional = next(a for a in get_args(hint) if a is not type(None)), True
        elif origin is Annotated:
            hint = get_args(hint)[0]
        elif origin is Literal:
            return type(get_args(hint)[0]), optional
        else:
            return hint, optional


def choices(hint: Any) -> tuple[str, ...]:
    """The names of a (possibly Optional) Literal field type."""
    while get_origin(hint) is not Literal:
        hint = next(a for a in get_args(hint) if a is not type(None))
    return get_args(hint)


_TYPE_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"),
               float: ("a number", "numbers"), str: ("a string", "strings")}


def _describe(hint: Any, item: bool) -> str:
    base, optional = unwrap(hint)
    if item:
        return _TYPE_NAMES[unwrap(get_args(base)[0])[0]][0]
    if is_section(base):
        text = "a mapping of settings (key: value)"
    elif get_origin(base) is list:
        text = f"a list of {_TYPE_NAMES[unwrap(get_args(base)[0])[0]][1]}"
    else:
        text = _TYPE_NAMES[base][0]
    return f"{text} or null" if optional else text


def interval(bounds: Mapping[str, Any]) -> str:
    """``{"gt": 0}`` -> "> 0"; ``{"ge": 0, "lt": 1}`` -> "in [0, 1)"."""
    low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    high = (bounds["lt"], ")") if "lt" in bounds else (bounds["le"], "]") if "le" in bounds else None
    if low and high:
        return f"in {low[0]}{_num(low[1])}, {_num(high[0])}{high[1]}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {_num(low[1])}"
    return f"{'<' if high[1] == ')' else '<='} {_num(high[0])}"


def _num(bound: Any) -> str:
    """A bound as written in the code: 2**32 rather than 4294967296."""
    if isinstance(bound, int) and bound > 1024 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return str(bound)


def _fix(key: str, info: FieldInfo) -> str:
    """"set e.g. key=<example or default>", and for an Optional field "set key=null <what null means>"."""
    default = info.get_default(call_default_factory=True)
    example = info.examples[0] if info.examples else default
    fixes = []
    if example is not None:
        fixes.append(f"set e.g. {key}={command_line(example)}" + (" (the default)" if example == default else ""))
    if unwrap(info.annotation)[1]:
        null = (info.json_schema_extra or {}).get("null", "")
        fixes.append(f"set {key}=null" + (f" {null}" if null else ""))
    return ", or ".join(fixes)


def shown_value(value: Any) -> str:
    return "null" if value is None else repr(value)


def command_line(value: Any) -> str:
    """``value`` as it is written on the command line: null, true, [a,b], 0.2."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(command_line(v) for v in value) + "]"
    return str(value)

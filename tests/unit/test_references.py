"""Names written in prose resolve: every dotted ``ray_ppo.…`` name in a docstring, comment or string
of the code, and in the Markdown docs, names a module, class, function or attribute that exists, and
no text names the packages the code has left (``train.``, ``makers.``). A rename that forgets the
prose fails here instead of sending a reader to nothing."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("ray_ppo", "benchmarks", "examples", "scripts", "tests")
DOCS = ("README.md", "docs", "benchmarks/README.md", "configs")  # not CHANGELOG.md: history names what was

NAME = re.compile(r"(?<![\w./-])ray_ppo(?:\.[A-Za-z_]\w*)+(?![\w-])")
GONE = re.compile(r"(?<![\w./-])(?:ray_ppo[./])?(?:core|runtime)[./][a-z_]+\b")
"""Paths in the packages the code left on 2026-12-06 (``ray_ppo.core``, ``ray_ppo.runtime``, their
folders and short forms such as ``runtime.loop``): the old module paths still import
(``ray_ppo._MOVED``), so only this scan tells a stale one."""
ALIASES = ("ray_ppo/__init__.py", "tests/unit/test_layout.py", "tests/unit/test_references.py")
"""Where old paths are named on purpose: the table that keeps them importing and its tests."""


def prose(path: Path, strings: bool = True) -> str:
    """The comments and docstrings of a Python file, and its other string literals if ``strings``
    (the package's error messages name modules too; the tests' strings are data, some of it wrong
    on purpose)."""
    source = path.read_text()
    pieces = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT or strings and token.type == tokenize.STRING]
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    pieces += [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(source)) if isinstance(node, documented)]
    return "\n".join(pieces)


def texts() -> dict[str, str]:
    out = {}
    for folder in CODE_DIRS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            out[str(path.relative_to(REPO_ROOT))] = prose(path, strings=folder != "tests")
    for entry in DOCS:
        path = REPO_ROOT / entry
        for doc in sorted(path.rglob("*.md") if path.is_dir() else [path]):
            out[str(doc.relative_to(REPO_ROOT))] = doc.read_text()
    return out


def instance_attributes(cls: type) -> set[str]:
    """``self.<name>`` assignments in the class's methods, and its annotated fields."""
    names = set(getattr(cls, "__annotations__", {}))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def resolves(dotted: str) -> bool:
    """An importable module, then attributes of it (a class's instance attributes count)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            if cut == len(parts) and importlib.util.find_spec(parts[0]) and _module_file(module):
                return True  # a module whose optional dependency is missing here (colossalai)
            continue
        for name in parts[cut:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif inspect.isclass(obj) and name in instance_attributes(obj):
                obj = None  # an instance attribute: nothing further to check below it
                break
            else:
                return False
        return True
    return False


def _module_file(module: str) -> bool:
    path = REPO_ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def names_in(text: str) -> set[str]:
    found = {m.group(0).rstrip(".") for m in NAME.finditer(text)}
    return {name for name in found if not name.endswith(("_py", ".py", ".md", ".yaml"))}


@pytest.fixture(scope="module")
def all_texts() -> dict[str, str]:
    return texts()


def test_the_scan_sees_names_and_catches_a_wrong_one(all_texts):
    names = set().union(*(names_in(text) for text in all_texts.values()))
    assert {"ray_ppo.coordinator.state", "ray_ppo.coordinator.ledger"} <= names and len(names) > 60
    assert resolves("ray_ppo.coordinator.actor.Coordinator.pull")
    assert resolves("ray_ppo.coordinator.actor.Coordinator.state")  # set in __init__
    assert not resolves("ray_ppo.coordinator.actor.Coordinator.no_such_method")
    assert not resolves("ray_ppo.train.no_such_module")


def test_every_dotted_name_in_prose_resolves(all_texts):
    broken = {}
    for where, text in all_texts.items():
        if where in ALIASES:
            continue  # old paths, named on purpose (the alias tests import each)
        bad = sorted(name for name in names_in(text) if not resolves(name))
        if bad:
            broken[where] = bad
    assert not broken, "names that do not exist: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in broken.items())


def test_no_text_names_a_package_the_code_left(all_texts):
    stale = {where: sorted(set(GONE.findall(text))) for where, text in all_texts.items()
             if GONE.search(text) and where not in ALIASES}
    assert not stale, f"paths of ray_ppo.core / ray_ppo.runtime, which the code left (docs/design.md maps it): {stale}"


BARE = re.compile(r"``([A-Z][A-Za-z0-9]*)\.([a-z_][A-Za-z0-9_]*)``")
"""A bare ``Class.attr`` in a docstring, comment or doc (no module path)."""


def package_classes() -> dict[str, list[type]]:
    """Class name -> the classes of that name defined in ``ray_ppo`` (imported module by module)."""
    import pkgutil

    import ray_ppo

    classes: dict[str, list[type]] = {}
    for info in pkgutil.walk_packages(ray_ppo.__path__, "ray_ppo."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (colossalai)
            continue
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == info.name:
                classes.setdefault(name, []).append(obj)
    return classes


def test_every_bare_class_attribute_in_prose_resolves(all_texts):
    classes = package_classes()
    assert "Coordinator" in classes and "PPOLearner" in classes  # the scan found the package's classes
    assert BARE.findall("see ``Coordinator.pull``") == [("Coordinator", "pull")]
    assert not any(hasattr(c, "no_such_method") for c in classes["Coordinator"])
    broken = {}
    for where, text in all_texts.items():
        if where in ALIASES:
            continue
        bad = sorted({f"{cls}.{attr}" for cls, attr in BARE.findall(text) if cls in classes
                      and not any(hasattr(c, attr) or attr in instance_attributes(c) for c in classes[cls])})
        if bad:
            broken[where] = bad
    assert not broken, "Class.attr names that do not exist: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in broken.items())

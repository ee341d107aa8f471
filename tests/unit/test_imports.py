"""What imports what: the synchronous loop stays free of Ray and of ``ray_ppo.runtime``, and no two modules of the package
import each other (directly or through others, counting imports inside functions too)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "ray_ppo"


def test_the_local_loop_imports_neither_ray_nor_the_runtime():
    """``ray-ppo local`` is the Ray-free loop: it imports no Ray and no ``ray_ppo.runtime`` module
    (the prompt shape, evaluation reports and prompt reading it shares with the runtime live
    outside it)."""
    code = ("import ray_ppo.local, sys; assert 'ray' not in sys.modules, 'ray_ppo.local imported ray'; "
            "runtime = sorted(m for m in sys.modules if m.startswith('ray_ppo.runtime')); "
            "assert not runtime, f'ray_ppo.local imported {runtime}'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_coordinator_does_not_import_torch():
    """The coordinator routes packed NumPy batches: its process skips torch's import (seconds of
    CPU at every fit() start on a small machine). It also holds the makers' handles, and Ray
    imports an actor's class module wherever it deserializes the actor's handle, so the maker's
    module is imported there too."""
    code = ("import ray_ppo.runtime.coordinator, ray_ppo.runtime.maker, ray_ppo.config, sys; "
            "assert 'torch' not in sys.modules, 'the coordinator or the maker module imported torch'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """Each module of ``ray_ppo`` -> the package's modules it imports anywhere in its text."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # ``from ray_ppo.core.models import tiny`` names a module
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for target in graph[node]:
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                stack.append((target, path + [target]))
    return None


def test_no_module_imports_itself_through_others():
    graph = package_imports()
    assert "ray_ppo.core.models.tiny" in graph["ray_ppo.core.models.hf"]  # the scan does see the package's imports
    cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_core_needs_no_ray_and_no_runtime():
    """The layout's promise: every module of ``ray_ppo.core`` imports without Ray, and none of
    them imports a ``ray_ppo.runtime`` module (the roles build on the core, never the reverse)."""
    graph = package_imports()
    core = sorted(name for name in graph if name.startswith("ray_ppo.core"))
    assert len(core) > 20  # the scan found the core's modules
    upward = {name: sorted(t for t in graph[name] if t.startswith(("ray_ppo.runtime", "ray_ppo.api", "ray_ppo.cli")))
              for name in core}
    assert not {k: v for k, v in upward.items() if v}
    skip = ("ray_ppo.core.colossalai_strategy", "ray_ppo.core.vllm_engine")  # optional extras, imported on use
    code = ("import importlib, sys\n"
            f"for name in {[n for n in core if n not in skip]!r}:\n"
            "    importlib.import_module(name)\n"
            "assert 'ray' not in sys.modules, 'a core module imported ray'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

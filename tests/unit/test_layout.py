"""The layout by role (docs/design.md maps it), kept: what the top level holds, which files import
Ray, what imports what. The synchronous loop stays free of Ray and of the distributed roles, and no
two modules of the package import each other (directly or through others, counting imports inside
functions too)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "ray_ppo"


def test_the_local_loop_imports_neither_ray_nor_the_actors():
    """``ray-ppo local`` is the Ray-free loop: it imports no Ray, no role's actor or loop and nothing
    of ``ray_ppo.cluster`` (it shares with the roles what needs no Ray)."""
    actors = sorted(name for name in ("ray_ppo.makers.worker", "ray_ppo.train.loop", "ray_ppo.coordinator.actor"))
    code = ("import ray_ppo.local, sys; assert 'ray' not in sys.modules, 'ray_ppo.local imported ray'; "
            f"roles = sorted(m for m in sys.modules if m in {actors!r} or m.startswith('ray_ppo.cluster')); "
            "assert not roles, f'ray_ppo.local imported {roles}'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_coordinator_does_not_import_torch():
    """The coordinator routes packed NumPy batches: its process skips torch's import (seconds of
    CPU at every fit() start on a small machine). It also holds the makers' handles, and Ray
    imports an actor's class module wherever it deserializes the actor's handle, so the maker's
    module is imported there too."""
    code = ("import ray_ppo.coordinator.actor, ray_ppo.makers.worker, ray_ppo.config, sys; "
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
                for alias in node.names:  # ``from ray_ppo.models import tiny`` names a module
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
    assert "ray_ppo.models.tiny" in graph["ray_ppo.models.hf"]  # the scan does see the package's imports
    cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


ENTRY_POINTS = ("ray_ppo.api", "ray_ppo.cli", "ray_ppo.local")
TOP_LEVEL = {"__init__.py", "api.py", "cli.py", "local.py", "env.py", "tools.py"}
"""The entry points, and the two modules users subclass and call from their own code."""
RAY_FILES = {
    "ray_ppo/api.py": "the driver: starts the actors and the TorchTrainer",
    "ray_ppo/cli.py": "the commands",
    "ray_ppo/makers/worker.py": "the maker actor",
    "ray_ppo/train/loop.py": "the Ray Train loop",
    "ray_ppo/coordinator/actor.py": "the coordinator actor, and the client the other roles call it with",
}
"""Outside ``ray_ppo/cluster/``, the only files that import Ray: one per role, and the entry points."""
RAY_FREE = ("ray_ppo.algo", "ray_ppo.models", "ray_ppo.wire", "ray_ppo.data", "ray_ppo.tasks")
"""Folders that import without Ray, whatever they import in turn."""
DRIVE_THE_TRAINER = {"ray_ppo.cluster.sweep", "ray_ppo.cluster.async_search"}
"""Tune entry points: each trial runs ``PPOTrainer`` (``ray_ppo.api``)."""


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_the_top_level_holds_the_entry_points_and_the_user_modules_only():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL


def test_only_the_listed_files_import_ray():
    """Ray is used in one file per role (and in ``cluster/``), so a Ray upgrade is read in a few
    files. Imports inside functions count."""
    users = {str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py")
             if any(m == "ray" or m.startswith("ray.") for m in imported_modules(p))}
    assert "ray_ppo/makers/worker.py" in users  # the scan sees imports
    outside = users - set(RAY_FILES) - {u for u in users if u.startswith("ray_ppo/cluster/")}
    assert not outside, f"files that import ray outside the one file of their role: {sorted(outside)}"
    private = {u for u in users if any(m.startswith("ray._private") for m in imported_modules(REPO_ROOT / u))}
    assert private == {"ray_ppo/cluster/ray_private.py"}


def test_the_ray_free_folders_import_without_ray():
    graph = package_imports()
    names = sorted(n for n in graph if n.startswith(RAY_FREE))
    assert len(names) > 25  # the scan found the folders' modules
    skip = ("ray_ppo.train.colossalai_strategy",)  # an optional extra, imported on use
    code = ("import importlib, sys\n"
            f"for name in {[n for n in names if n not in skip]!r}:\n"
            "    importlib.import_module(name)\n"
            "assert 'ray' not in sys.modules, 'a Ray-free module imported ray'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_folder_imports_an_entry_point():
    graph = package_imports()
    upward = {name: sorted(t for t in targets if t in ENTRY_POINTS) for name, targets in graph.items()
              if name.count(".") >= 2 and name not in DRIVE_THE_TRAINER}
    assert not {name: targets for name, targets in upward.items() if targets}


def test_paths_from_before_the_layout_import_the_same_modules():
    """Old module paths (docs, user code, notebooks) import as the module that moved, one object."""
    import importlib

    import ray_ppo

    for old, new in ray_ppo._MOVED.items():
        if new == "ray_ppo.train.colossalai_strategy":
            continue  # needs colossalai
        assert importlib.import_module(old) is importlib.import_module(new), old
    from ray_ppo.core.models.tiny import resolve_pretrained  # a module of a package that moved whole
    from ray_ppo.runtime import loop

    assert resolve_pretrained.__module__ == "ray_ppo.models.tiny" and loop.__name__ == "ray_ppo.train.loop"

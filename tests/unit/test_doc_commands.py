"""Every command that README.md, docs/ and the examples' usage lines show is accepted as written:
its arguments parse with the real parser, the files it names exist, and its config with its
overrides validates (what `ray-ppo train` checks before Ray starts). A synopsis placeholder (FILE,
RUN_DIR, [optional parts], ...) is not a command; a user's own config (`my.yaml`) is read as
configs/tiny.yaml so its overrides are still checked. The commands that take minutes run in
full in tests/e2e (the README's Python blocks, the examples, `ray-ppo train/tune/local/eval`)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from ray_ppo import cli
from ray_ppo.config import load_config

REPO = Path(__file__).parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(ray-ppo|python (examples|benchmarks|scripts)/\S+\.py)( |$)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(=[A-Z_.]+)?$|\.\.\.|[<>|]")
USER_CONFIG = "my.yaml"
CONFIG_COMMANDS = ("train", "local", "tune", "config", "eval")


def _split_fences(text: str) -> tuple[list[str], list[str]]:
    """(the lines inside ``` fences, the lines outside)."""
    inside_lines, outside_lines, inside = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        else:
            (inside_lines if inside else outside_lines).append(line)
    return inside_lines, outside_lines


def _fenced_lines(text: str) -> list[str]:
    """The lines inside ``` fences, line continuations joined."""
    return re.sub(r"\\\n\s*", " ", "\n".join(_split_fences(text)[0])).splitlines()


def _inline(text: str) -> list[str]:
    """The inline code spans outside fences (a span may wrap over lines)."""
    return re.findall(r"`([^`]+)`", re.sub(r"\s*\n\s*", " ", "\n".join(_split_fences(text)[1])))


def _command(text: str) -> str | None:
    """``text`` as a command to check, or None: a synopsis, an output line, a fragment."""
    text = text.split("#")[0].strip().removeprefix("$ ")
    text = re.sub(r"\s+\[[^\]]*\]", "", text)  # optional parts of a synopsis
    if not COMMAND.match(text) or re.match(r"\S+ \S+:", text):  # an output line: `ray-ppo train: warning: ...`
        return None
    words = shlex.split(text)
    if len(words) < 3 and words[-1] != "--version":  # a command named in prose: `ray-ppo train`
        return None
    if any(PLACEHOLDER.search(w) for w in words):
        return None
    return " ".join(shlex.quote(w) for w in words)


def _commands() -> list[tuple[str, str]]:
    found = {}
    sources = [(doc.relative_to(REPO), _fenced_lines(doc.read_text()) + _inline(doc.read_text())) for doc in DOCS]
    for example in sorted((REPO / "examples").glob("*.py")):  # the usage lines of each example's docstring
        sources.append((example.relative_to(REPO), _fenced_lines(example.read_text()) + example.read_text().splitlines()))
    for where, texts in sources:
        for text in texts:
            command = _command(text)
            if command and command not in found:
                found[command] = str(where)
    return sorted((where, command) for command, where in found.items())


COMMANDS = _commands()


def test_the_docs_show_the_commands_this_test_checks():
    shown = " ".join(command for _, command in COMMANDS)
    for command in ("ray-ppo train", "ray-ppo tune", "ray-ppo local", "ray-ppo eval", "ray-ppo toy-data",
                    "python examples/fit_from_script.py"):
        assert command in shown


def _check_ray_ppo(words: list[str]) -> None:
    words = ["configs/tiny.yaml" if w == USER_CONFIG else w for w in words]
    if "maker.engine=vllm" in words and importlib.util.find_spec("vllm") is None:
        pytest.skip("maker.engine=vllm validates only where vllm is installed (make test-vllm's environment)")
    try:
        args = cli.parse_args(words[1:])
    except SystemExit as e:  # --version, --help
        assert e.code == 0
        return
    if args.command not in CONFIG_COMMANDS:
        return
    config = args.config
    if config is not None:
        assert (REPO / config).is_file(), f"--config {config} does not exist"
    if args.command == "eval" and config is None:
        return  # the run's own config.yaml (a run directory the docs name)
    cfg = load_config(REPO / config if config else None, args.overrides)
    if args.command == "tune" and args.async_search is None:
        for key, values in cli._sweep_spec(args)["grid"].items():
            for value in values:
                cfg.with_overrides({key: value})


def _load_example(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where, command, monkeypatch):
    monkeypatch.chdir(REPO)
    words = shlex.split(command)
    if words[0] == "ray-ppo":
        _check_ray_ppo(words)
        return
    script = REPO / words[1]
    assert script.is_file(), f"{where}: {words[1]} does not exist"
    # an example that builds its config in run_config: parse, and build the config the run would use (others are
    # not imported: submit_job.py sets Ray's auth mode for the whole process at import)
    if words[1].startswith("examples/") and "def run_config(" in script.read_text():
        module = _load_example(script)
        module.run_config(module.parse_args(words[2:]))

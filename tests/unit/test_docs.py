"""The docs stay short, current and complete: the README and the benchmarks page within their
length, no doc or docstring narrating the project's history, the configuration reference listing
every key ``ray-ppo config`` lists, and the README's links pointing at files that exist. The docs
site itself is built strictly by ``make test`` (``make docs``), which fails on a broken link."""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

from ray_ppo.config import Config
from ray_ppo.config.reference import describe_config, reference_markdown

ROOT = Path(__file__).parents[2]
MAX_LINES = {"README.md": 250, "benchmarks/README.md": 500}
DIARY = re.compile("|".join([r"\b(first|second|third|[a-z]+teenth|twenty-[a-z]+|[0-9]+(st|nd|rd|th))\s+session",
                             r"\b(this|last|earlier|previous|next)\s+sessions?\b"]), re.I)
"""How a diary names when something happened; docs say what is true now, with dates and commit
hashes where history matters."""
SCANNED = ("*.md", "*.py", "*.yaml", "*.yml", "*.toml", "Makefile")
SKIPPED_DIRS = {".git", ".venv", ".venv-colossalai", ".venv-vllm", ".venv-trl", "runs", "site", ".cache",
                "__pycache__", "ray_ppo.egg-info", "build", "dist"}


def project_files() -> list[Path]:
    """The project's own text files: its directories walked with environments and outputs left out."""
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith(".venv")]
        files += [Path(directory, n) for n in names if any(fnmatch.fnmatch(n, p) for p in SCANNED)]
    return sorted(f for f in files if f != Path(__file__))


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_the_readmes_stay_within_their_length(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= MAX_LINES[name], f"{name} has {lines} lines; move detail into docs/ (at most {MAX_LINES[name]})"


def test_no_doc_or_docstring_narrates_the_projects_history():
    found = []
    for path in project_files():
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())  # a phrase may wrap
        found += [f"{path.relative_to(ROOT)}: ...{m.group(0)}..." for m in DIARY.finditer(text)]
    assert not found, "diary words (say what is true now; a date or commit hash where history matters):\n" + \
        "\n".join(found)


def test_the_diary_pattern_finds_what_it_is_meant_to():
    # Each phrase in two parts, so that this file holds none of them for a grep of the project to find.
    for when, word in (("in the twenty-third", "session"), ("the fourteenth\n ", "session's change"),
                       ("this", "session"), ("in earlier", "sessions"), ("the 3rd", "session")):
        phrase = f"{when} {word}"
        assert DIARY.search(" ".join(phrase.split())), phrase
    for phrase in ("the session's Ray cluster", 'scope="session"', "a session temporary directory"):
        assert not DIARY.search(phrase), phrase


def test_the_configuration_reference_lists_every_key_that_ray_ppo_config_lists():
    listed = [line.split(" = ")[0] for line in describe_config(Config()).splitlines()
              if line and not line.startswith((" ", "["))]
    referenced = re.findall(r"^\| `([\w.]+)` \|", reference_markdown(), flags=re.M)
    assert sorted(referenced) == sorted(listed) and len(set(referenced)) == len(referenced)
    assert len(listed) > 80  # every section's keys, not a few


def test_the_configuration_page_takes_the_generated_reference():
    """The docs build replaces the page's marker (scripts/docs_hooks.py, a hook of mkdocs.yml)."""
    hooks = (ROOT / "scripts" / "docs_hooks.py").read_text()
    assert "scripts/docs_hooks.py" in (ROOT / "mkdocs.yml").read_text()
    marker = re.search(r'"configuration.md": "(<!-- [\w-]+ -->)"', hooks).group(1)
    assert marker in (ROOT / "docs" / "configuration.md").read_text()


def test_the_readmes_relative_links_point_at_files_that_exist():
    for name in ("README.md", "benchmarks/README.md", "CHANGELOG.md"):
        page = ROOT / name
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{name} links to {target}, which does not exist"

"""Benchmark results as data: each script's ``publish`` writes its table with where and how it was
measured (``benchmarks/_common.py``), and benchmarks/README.md's marked tables are built from those
files (``benchmarks/render.py``), so the README shows only what a script produced."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import render  # noqa: E402

import _common  # noqa: E402


def test_publish_prints_the_table_and_writes_it_with_its_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(_common.RESULTS_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "argv", [str(_common.ROOT / "benchmarks" / "coordinator_scale.py"), "--repeats", "1"])
    out = _common.publish("coordinator_scale", ["variant", "items/s"], [["inline", 7284.5]],
                          args=argparse.Namespace(repeats=1), title="Coordinator scale")
    assert "| inline | 7,284 |" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert out == tmp_path / "coordinator_scale.json" and not list(tmp_path.glob("*.tmp"))
    assert record["command"] == "python benchmarks/coordinator_scale.py --repeats 1"
    assert record["args"] == {"repeats": 1} and record["rows"] == [["inline", 7284.5]]
    assert record["machine"]["cores"] >= 1 and "torch" in record["machine"] and record["commit"]
    assert set(record["machine"]["cpu_features"]) <= set(_common.CPU_FEATURES)
    m = record["machine"] | {"cpu": "AMD EPYC", "cpu_features": ["avx2"], "cores": 2, "load_average_1m": 1.5}
    assert "2 cores (AMD EPYC, avx2), load average 1.5" in render.provenance(record | {"machine": m})
    del m["cpu_features"]  # a file written before the features were recorded
    assert "2 cores (AMD EPYC), load average 1.5" in render.provenance(record | {"machine": m})


def test_a_quick_run_writes_where_the_readme_never_reads(monkeypatch):
    monkeypatch.delenv(_common.RESULTS_ENV, raising=False)
    monkeypatch.setenv(_common.QUICK_ENV, "1")
    assert _common.results_dir() == _common.RESULTS / "quick"
    monkeypatch.setenv(_common.QUICK_ENV, "0")
    assert _common.results_dir() == _common.RESULTS


def test_a_marked_block_is_rebuilt_from_its_results_file_and_the_prose_around_it_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(_common.RESULTS_ENV, str(tmp_path))
    _common.publish("weight_sync", ["makers", "GB/s"], [[2, 6.61]], title="Weight sync")
    readme = "Prose before.\n\n<!-- results: weight_sync -->\nan old table\n<!-- /results -->\n\nProse after.\n"
    new, changed = render.render(readme, tmp_path)
    assert changed == ["weight_sync"]
    assert new.startswith("Prose before.\n\n<!-- results: weight_sync -->\n`python ") and new.endswith(
        "| 2 | 6.61 |\n\n<!-- /results -->\n\nProse after.\n")
    assert render.render(new, tmp_path) == (new, [])  # rebuilt: nothing left to change


def test_the_readme_shows_what_the_committed_results_hold():
    """What ``python benchmarks/render.py --check`` checks: every marked table of the benchmark pages
    is its results file's table, and at least the headline figures are marked."""
    marked = set()
    for page in render.PAGES:
        text = page.read_text()
        assert render.render(text)[1] == [], f"{page.name}: run python benchmarks/render.py"
        marked |= {m["name"] for m in render.BLOCK.finditer(text)}
    assert {"coordinator_scale", "weight_sync", "overlap_sim", "env_utilisation"} <= marked
    assert {p.name for p in render.PAGES} == {"README.md", "real-models.md", "streaming.md"}


def test_a_block_may_show_some_of_the_columns(tmp_path, monkeypatch):
    monkeypatch.setenv(_common.RESULTS_ENV, str(tmp_path))
    _common.publish("overlap_sim", ["ranks", "makers", "ratio / ideal"], [[1, 2, 0.98], [2, 2, 0.97]])
    readme = '<!-- results: overlap_sim columns="makers | ratio / ideal" -->\n<!-- /results -->\n'
    new, _ = render.render(readme, tmp_path)
    assert "| makers | ratio / ideal |\n|---|---|\n| 2 | 0.98 |\n| 2 | 0.97 |\n" in new


def test_a_block_may_show_some_of_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv(_common.RESULTS_ENV, str(tmp_path))
    _common.publish("weight_sync", ["model", "makers"], [["100M", 1], ["1G", 1], ["1G", 2]])
    readme = '<!-- results: weight_sync where="model=1G" columns="makers" -->\n<!-- /results -->\n'
    assert "| makers |\n|---|\n| 1 |\n| 2 |\n" in render.render(readme, tmp_path)[0]

"""The headline benchmarks run as smoke checks: coordinator items/s, weight-push GB/s and the
simulated overlap ratio, each in a small run of its script (as ``make bench-quick`` runs it),
against the figure of the committed full run (``benchmarks/results``) with a generous tolerance.

They catch a change that breaks a benchmark script, or that costs a multiple of a figure (the
coordinator once moved 506 items/s where it now moves thousands), not a few percent: a loaded CI
machine, and a run this small, move the figures by more than that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from ray_processes import REPO, RUN_TIMEOUT_S

pytestmark = pytest.mark.e2e
RESULTS = REPO / "benchmarks" / "results"
THROUGHPUT_SHARE = 0.15
"""A small run on a loaded machine must reach this share of the committed full run's throughput."""
RATIO_MARGIN = 0.3
"""... and an overlap ratio no more than this below it."""


def run_script(name: str, args: list[str], tmp_path) -> dict:
    """``benchmarks/NAME.py ARGS`` in quick mode, with a Ray temp dir of its own; its results record."""
    env = {**os.environ, "RAY_PPO_BENCH_QUICK": "1", "RAY_PPO_BENCH_RESULTS": str(tmp_path),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="rp_", dir="/tmp")}  # short: Ray's socket paths have a length limit
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{name}.py failed:\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return json.loads((tmp_path / f"{name}.json").read_text())


def row_where(record: dict, cells: dict) -> dict:
    """The first row (as header -> value) that holds ``cells`` (header -> value)."""
    rows = [dict(zip(record["headers"], row)) for row in record["rows"]]
    found = [r for r in rows if all(r[k] == v for k, v in cells.items())]
    assert found, f"no row of {record['benchmark']} has {cells}"
    return found[0]


def committed(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_the_coordinator_moves_thousands_of_items_a_second(tmp_path):
    quick = run_script("coordinator_scale", ["--repeats", "1", "--items", "2048", "--grid", "headline"], tmp_path)
    cell = {"variant": "inline", "makers": 16, "ranks": 4, "items per batch": 32}
    got, full = row_where(quick, cell), row_where(committed("coordinator_scale"), cell)
    assert got["lost"] == 0 and got["duplicated"] == 0
    assert got["items/s"] >= THROUGHPUT_SHARE * full["items/s"], (got["items/s"], full["items/s"])


def test_a_weight_push_reaches_two_makers_exact_at_gigabytes_a_second(tmp_path):
    quick = run_script("weight_sync", ["--repeats", "1", "--sizes", "100M", "--makers", "2", "--variants", "zero-copy",
                                       "--naive-max-makers", "0"], tmp_path)
    cell = {"model": "100M", "makers": 2, "push": "zero-copy"}
    got, full = row_where(quick, cell), row_where(committed("weight_sync"), cell)
    assert got["weights equal"] == "yes"
    gbs = "e2e GB/s (bytes once)"
    assert got[gbs] >= THROUGHPUT_SHARE * full[gbs], (got[gbs], full[gbs])


def test_detached_steps_overlap_generation_and_training(tmp_path):
    quick = run_script("overlap_sim", ["--repeats", "1", "--ratios", "1:1", "--makers", "2", "--ranks", "1",
                                       "--steps", "8", "--skip", "3"], tmp_path)
    cell = {"ranks": 1, "makers": 2, "T_gen:T_train": "1:1", "prefetch": "on"}
    got, full = row_where(quick, cell), row_where(committed("overlap_sim"), cell)
    assert got["weights in sync"] == "yes"
    assert got["ratio / ideal"] >= full["ratio / ideal"] - RATIO_MARGIN, (got["ratio / ideal"], full["ratio / ideal"])

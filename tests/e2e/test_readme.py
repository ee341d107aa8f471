"""Every Python block in README.md runs as written, as a user pastes it into a script (the
sweep's grid cut to two of its four trials: see its test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
from ray_processes import REPO, RUN_TIMEOUT_S

pytestmark = pytest.mark.e2e
BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)


def run_block(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` as a script in a directory of its own holding the repository's configs/ and data/
    (so its run files stay there), with a Ray temp dir of its own (so a plain ``ray.init()`` finds
    no other cluster of the machine to attach to)."""
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "snippet.py").write_text(code)
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rp_", dir="/tmp")}  # short: socket path limit
    proc = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=2 * RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"README block failed:\n{code}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


def test_readme_has_the_quick_start_and_the_sweep():
    assert len(BLOCKS) == 2, "a Python block was added to README.md: give it a test below"
    assert "PPOTrainer(cfg)" in BLOCKS[0] and "sweep(cfg" in BLOCKS[1]


def test_the_python_quick_start_runs_as_written(tmp_path):
    proc = run_block(BLOCKS[0], tmp_path)
    lines = proc.stdout.splitlines()
    plan, result = [line for line in lines if line.startswith("resources: ")], lines[-1]
    assert len(plan) == 1 and plan[0].startswith("resources: 2 makers x 0.5 CPU + 1 trainer worker x 1 CPU")
    assert any(line.startswith("checkpoint of step ") for line in lines)  # its size, said once
    reward, checkpoint = result.split(" ", 1)
    assert 0 <= float(reward) <= 1 and "Checkpoint(" in checkpoint and str(tmp_path / "runs") in checkpoint


EPS_CLIP_GRID = '"ppo.eps_clip": tune.grid_search([0.1, 0.2])'
"""The snippet's second grid key. Its test runs it with one value: 2 trials, not 4. A trial is
~75 s of process start-up on 2 cores whatever its steps, and the product of two grids is Tune's
(``test_ray_ppo_tune_sweeps_two_keys`` checks that both keys reach the trials)."""


def test_the_sweep_snippet_runs_as_written_and_prints_what_the_cli_prints(tmp_path):
    """One line per trial and the snippet's own print; not Tune's tables, nor the trials' logs
    (the snippet printed 537 lines when sweep() left Tune's output and the workers' logs on)."""
    assert BLOCKS[1].count(EPS_CLIP_GRID) == 1, "the README's sweep changed: update EPS_CLIP_GRID"
    proc = run_block(BLOCKS[1].replace(EPS_CLIP_GRID, '"ppo.eps_clip": tune.grid_search([0.2])'), tmp_path)
    lines = proc.stdout.splitlines()
    trials = [line for line in lines if line.startswith("trial ")]
    assert [line.split(" done:")[0] for line in trials] == [f"trial {i}/2" for i in range(1, 3)]
    assert len(lines) == 3 and lines[-1].startswith("{'ppo.kl_coef': ")
    assert "worker processes have been started" not in proc.stdout + proc.stderr
    # stderr: Ray's own start-up lines and Tune's closing one, nothing from the trials
    assert len(proc.stderr.splitlines()) <= 6 and "pid=" not in proc.stderr and "Traceback" not in proc.stderr

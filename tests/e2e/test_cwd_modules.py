"""A reward function in the current directory, named as `module:function`, is found by the
`ray-ppo` script (whose own path holds only its folder) in pre-flight, in `eval` and on the
run's Ray workers, as `python -m` would find it; one that is nowhere says where it was looked for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
RAY_PPO = str(Path(sys.executable).parent / "ray-ppo")
REWARD = """
def reward(prompts, responses):
    return [float(r.strip()[:1] == p.split()[-1]) for p, r in zip(prompts, responses)]
"""


def run(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([RAY_PPO, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_module_in_the_current_directory_is_found_by_every_command(tmp_path):
    (tmp_path / "my_reward.py").write_text(REWARD)
    prompts = str(REPO / "data" / "toy_prompts.csv")
    proc = run(tmp_path, "eval", "tiny", "--data", prompts, "--num-prompts", "4", "model.reward_fn=my_reward:reward")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reward my_reward:reward" in proc.stdout
    proc = run(tmp_path, "train", "--config", str(REPO / "configs" / "tiny.yaml"), "--output", "run",
               f"data.path={prompts}", "model.reward_fn=my_reward:reward", "trainer.total_steps=2",
               "trainer.train_batch_size=8", "trainer.mini_batch_size=8", "maker.batch_size=4",
               "maker.num_makers=1", "logging.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout


def test_a_module_found_nowhere_names_where_it_was_looked_for(tmp_path):
    proc = run(tmp_path, "eval", "tiny", "--data", str(REPO / "data" / "toy_prompts.csv"),
               "model.reward_fn=fruit_reward:reward", timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "no module named 'fruit_reward' in the current directory, on PYTHONPATH" in proc.stderr

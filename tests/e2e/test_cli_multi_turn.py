"""`ray-ppo train` with an environment (issue 42), as a user runs it: two-turn episodes of the toy
task with an async environment that sleeps 50-200 ms a step (``ray_ppo.makers.testing.FaultyEnv``), where
every 64th prompt makes the step raise, hang past ``env.step_timeout_s`` or return garbage. The run
goes on, shows each fault with its prompt, and its reward rises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_ppo.tasks.toy import make_prompts

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
STEPS = 50


def fault_prompts(path: Path) -> Path:
    """1024 toy prompts that start with 3-9, except every 64th from the 64th: 0 (raise), 1 (hang), 2 (garbage)."""
    prompts = [p for p in make_prompts(4000, 6, seed=0) if p[0] not in "012"][:1024]
    for i in range(64, len(prompts), 64):
        prompts[i] = "012"[(i // 64) % 3] + prompts[i][1:]
    path.write_text("prompt\n" + "\n".join(prompts) + "\n")
    return path


def test_two_turn_episodes_train_through_faults_and_the_reward_rises(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml", "--output", str(out),
         "env.cls=ray_ppo.makers.testing:FaultyEnv", "env.step_timeout_s=1", "env.max_tokens=32",
         f"data.path={fault_prompts(tmp_path / 'prompts.csv')}", f"trainer.total_steps={STEPS}", "maker.num_makers=1"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first + 0.15, (first, last)  # ~0.06 -> ~0.45 here (reward in [0, 1], two turns of half each)
    assert all(1.8 <= r["env/turns"] <= 2.0 for r in rows)
    assert sum(r["env/fault"] > 0 for r in rows) >= 5
    shown = [line for line in proc.stdout.splitlines() if "episode ended on an environment fault" in line]
    assert any("step raised RuntimeError: the environment broke" in line and "prompt '0 " in line for line in shown)
    assert any("env.step_timeout_s=1 s" in line and "prompt '1 " in line for line in shown)
    assert any("not a ray_ppo.env.Turn" in line and "prompt '2 " in line for line in shown)
    faults = [s for s in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if "fault" in s]
    assert faults and all(s["prompt"][0] in "012" for s in faults)
    assert f"{round(sum(r['fault_count'] for r in rows))} episodes ended on an environment fault" in proc.stdout

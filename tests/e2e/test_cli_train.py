"""`ray-ppo train` as a user runs it: a subprocess with its own local Ray cluster."""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]


def test_ray_ppo_train_writes_metrics_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    staged_before = set(Path(tempfile.gettempdir()).glob("ray_ppo_ckpt_*"))
    proc = subprocess.run(
        [sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml", "--output", str(out),
         "trainer.total_steps=3", "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8",
         "maker.num_makers=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all({"reward_mean", "kl", "policy_version"} <= r.keys() for r in rows)
    assert "step 3/3 | reward" in proc.stdout and "done: 3 steps" in proc.stdout
    # a normal end is quiet: no retry warning from the makers' loops, no traceback (issue 16)
    assert "retries remaining" not in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    # and no error-level line from Ray's core (it printed one for the makers' constructor
    # arguments while they held the coordinator's handle: see RunHandles)
    assert not re.findall(r"^\[[^\]]* E \d+ \d+\].*", proc.stderr, re.M), proc.stderr[-3000:]
    assert (out / "config.yaml").exists()
    assert (out / "checkpoint" / "actor" / "model.safetensors").exists()
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    # rank 0 stages each checkpoint in a temporary directory; once Ray Train has its copy, none is left
    assert set(Path(tempfile.gettempdir()).glob("ray_ppo_ckpt_*")) == staged_before

    # TensorBoard files hold every step of the main metrics, equal to metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"reward_mean", "kl", "policy_loss", "value_loss", "samples_per_s", "policy_version"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])
    # the curves PNG opens as an image
    from matplotlib.image import imread

    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert min(imread(out / "curves.png").shape[:2]) > 100
    # --resume is tested in test_cli_resume.py (after Ctrl-C, kill -9, and a finished run)


def test_ray_ppo_train_bad_override_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml",
                           "ppo.kl_cof=0.1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean 'ppo.kl_coef'" in proc.stderr

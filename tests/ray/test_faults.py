"""Fault injection on a local CPU cluster: kill a maker, a trainer worker, the coordinator; resume."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.train import FailureConfig, RunConfig

from ray_ppo.api import PPOTrainer
from ray_ppo.core.checkpoint import publish_checkpoint, validate_checkpoint
from ray_ppo.config import load_config
from ray_ppo.runtime.messages import CoordinatorStatus

pytestmark = pytest.mark.ray
REPO = Path(__file__).parents[2]
PROMPTS = [line.strip() for line in open(REPO / "data" / "toy_prompts.csv")][1:]


def config(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml", [
        "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8", "logging.report_every=1",
        "trainer.pull_timeout_s=60", f"logging.output_dir={tmp_path}", *overrides])


def when_step(trainer: PPOTrainer, step: int, action, timeout_s: float = 240) -> threading.Thread:
    """Run ``action()`` in a thread once the run has reported ``step``."""
    def wait_then_act():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(m["step"] >= step for m in list(trainer.history)):
                action()
                return
            time.sleep(0.1)
    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


def accounted(status: CoordinatorStatus) -> bool:
    c = status.counters
    return c.produced == c.consumed + c.in_flight + c.discarded + c.lost_in_transit


def trained_ids(state: dict) -> list[int]:
    """Prompt ids in a checkpoint's per-step log of trained prompts, step by step."""
    return [pid for _, ids in state["data"]["trained"] for pid in ids]


def test_resume_continues_step_version_and_prompt_position(ray_session, tmp_path):
    base = ["maker.num_makers=1", "data.shuffle=false"]
    first = PPOTrainer(config(tmp_path, *base, "trainer.total_steps=2"))
    result = first.fit()
    with result.checkpoint.as_directory() as directory:
        publish_checkpoint(directory, tmp_path, step=2)
    saved = validate_checkpoint(tmp_path / "checkpoint")
    assert saved["step"] == 2 and saved["policy_version"] == 2
    trained = trained_ids(saved)
    assert len(trained) == 2 * 16 == len(set(trained))  # one item per prompt: 32 prompts, each once

    resumed = PPOTrainer(config(tmp_path, *base, "trainer.total_steps=4"), resume_from=tmp_path / "checkpoint")
    result = resumed.fit()
    assert [m["step"] for m in resumed.history] == [3, 4]
    assert [m["policy_version"] for m in resumed.history] == [3, 4]
    # The resumed stream starts at the first prompt (file order: data.shuffle=false) not trained
    # by the checkpoint: prompts are read in file order (Ray Data's preserve_order), so this
    # holds on every run, not only when Ray Data happens to keep the blocks in order.
    assert first.final_status.data["first_prompt"] == PROMPTS[0]
    assert resumed.final_status.data["first_prompt"] == PROMPTS[saved["data"]["watermark"]]
    with result.checkpoint.as_directory() as directory:
        trained = trained_ids(validate_checkpoint(directory))
    assert len(trained) == 4 * 16 == len(set(trained))  # across the resume: no prompt trained twice
    assert resumed.history[-1]["weights_in_sync"] == 1.0


def test_killed_maker_is_restarted_and_resynced(ray_session, tmp_path):
    trainer = PPOTrainer(config(tmp_path, "trainer.total_steps=8", "maker.num_makers=2", "maker.max_restarts=2"))
    killed = {}

    def kill_maker_0():
        killed["pid"] = ray.get(trainer.makers[0].ping.remote())
        killed["at"] = time.monotonic()
        os.kill(killed["pid"], signal.SIGKILL)

    when_step(trainer, 2, kill_maker_0)
    trainer.fit()
    status = trainer.final_status
    assert killed and status.makers[0].restarts == 1 and status.makers[1].restarts == 0
    assert trainer.history[-1]["step"] == 8
    assert trainer.history[-1]["weights_in_sync"] == 1.0  # the restarted maker resynced to the last push
    assert accounted(status)
    assert status.counters.lost >= 0  # prompts that died with the maker are counted, not silently dropped
    assert status.counters.lost_in_transit == 0  # inline transport: what it had sent is the coordinator's
    print(f"maker kill: lost {status.counters.lost} prompts; run finished "
          f"{time.monotonic() - killed['at']:.1f} s after the kill")


def test_killed_trainer_worker_restarts_from_checkpoint(ray_session, tmp_path):
    # The kill comes once step 3 is seen in the history, which lags the trainer by a poll or two.
    # With checkpoints at 3 and 6 it lands in steps 4-6, so the group restarts from step 3 and
    # reruns what followed; with checkpoints every 2 steps a late kill could fall just after a
    # checkpoint, and nothing would run twice (seen in CI).
    cfg = config(tmp_path, "trainer.total_steps=7", "trainer.checkpoint_every=3", "maker.num_makers=1")
    trainer = PPOTrainer(cfg, run_config=RunConfig(
        name="restart", storage_path=str(tmp_path / "ray_train"),
        failure_config=FailureConfig(max_failures=1, controller_failure_limit=0)))
    killed = {}

    def kill_rank_0():
        killed["pid"] = ray.get(trainer.coordinator.status.remote()).rank_pids[0]
        os.kill(killed["pid"], signal.SIGKILL)

    when_step(trainer, 3, kill_rank_0)
    result = trainer.fit()
    steps = [m["step"] for m in trainer.history]
    versions = [m["policy_version"] for m in trainer.history]
    assert killed and result.metrics["step"] == 7 and steps[-1] == 7
    assert len(steps) > len(set(steps))  # steps after the checkpoint ran again
    assert versions == sorted(versions)  # the makers never saw the policy version go backwards
    status = trainer.final_status
    assert all(m.restarts == 0 for m in status.makers.values())  # makers and coordinator survived
    assert trainer.history[-1]["weights_in_sync"] == 1.0
    assert accounted(status)
    # Exactly once: what the killed group trained after its checkpoint was served again (rewound),
    # and the final checkpoint's log holds each prompt once, over steps 1..7.
    with result.checkpoint.as_directory() as directory:
        state = validate_checkpoint(directory)
    trained = trained_ids(state)
    assert len(trained) == 7 * 16 == len(set(trained))
    assert [s for s, _ in state["data"]["trained"]] == [1, 2, 3, 4, 5, 6, 7]
    assert status.counters.prompts_requeued > 0


def test_killed_coordinator_fails_the_run_clearly(ray_session, tmp_path):
    trainer = PPOTrainer(config(tmp_path, "trainer.total_steps=200", "maker.num_makers=1"))
    when_step(trainer, 2, lambda: ray.kill(trainer.coordinator, no_restart=True))
    start = time.monotonic()
    with pytest.raises(Exception, match="coordinator actor died.*--resume"):
        trainer.fit()
    assert time.monotonic() - start < 120
    assert trainer.namespace not in {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}

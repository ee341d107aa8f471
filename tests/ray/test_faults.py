"""Fault injection on a local CPU cluster: kill a maker, a trainer worker, the coordinator; resume."""

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.train import FailureConfig, RunConfig

from ray_ppo.api import PPOTrainer
from ray_ppo.config import load_config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.makers.testing import WaitingExperienceMaker
from ray_ppo.models.continuous import ContinuousBatcher
from ray_ppo.train.checkpoint import RunState, validate_checkpoint
from ray_ppo.wire.messages import CoordinatorStatus

pytestmark = pytest.mark.ray
REPO = Path(__file__).parents[2]
PROMPTS = [line.strip() for line in open(REPO / "data" / "toy_prompts.csv")][1:]


def config(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml", [
        "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8", "logging.report_every=1",
        "trainer.pull_timeout_s=60", f"logging.output_dir={tmp_path}", *overrides])


def when(predicate, action, timeout_s: float = 240) -> threading.Thread:
    """Run ``action()`` in a thread once ``predicate()`` holds."""
    def wait_then_act():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                action()
                return
            time.sleep(0.1)
    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


def when_step(trainer: PPOTrainer, step: int, action, timeout_s: float = 240) -> threading.Thread:
    """Run ``action()`` in a thread once the run has reported ``step``."""
    return when(lambda: any(m["step"] >= step for m in list(trainer.history)), action, timeout_s)


def past_checkpoint(trainer: PPOTrainer, run_dir: Path, at_least: int):
    """True once ``run_dir/checkpoint`` (published by fit()) holds a step >= ``at_least`` and the
    run has reported a later step: a kill then lands after a reported step that a restart redoes."""
    def check() -> bool:
        try:
            saved = json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            return False
        return saved >= at_least and max((m["step"] for m in list(trainer.history)), default=0) > saved
    return check


def accounted(status: CoordinatorStatus) -> bool:
    c = status.counters
    return c.produced == c.consumed + c.in_flight + c.discarded + c.lost_in_transit


def trained_ids(state: RunState) -> list[int]:
    """Prompt ids in a checkpoint's per-step log of trained prompts, step by step."""
    return [pid for _, ids in state.data["trained"] for pid in ids]


STREAMING = ("maker.max_running=6", "maker.samples_per_prompt=2", "algo.advantage=grpo",
             "maker.weight_updates=in_flight", "maker.max_new_tokens=48")
"""Streaming makers (continuous batching, each prompt's group sent as it finishes; pushes swap in
between two decode steps), as ``tests/ray/test_pipeline.py`` runs them."""


class SlowDecoding(ContinuousBatcher):
    """The continuous batcher, each of whose steps takes ``STEP_S`` more: generation, not training,
    bounds the run, as on a device where a push lands while sequences run. (On 2 CPU cores the tiny
    model answers in 5-10 tokens and trains a step in ~0.06 s: makers wait for admission ~all the
    time: in 2 of ~14 runs of 6-8 steps no push found a sequence running, and with 20-30 ms a step
    4 did in one. With 50 ms, 24-40 sequences were running at the pushes of each run of 8 steps,
    which took no longer: ~25 s.)"""

    STEP_S = 0.05

    def step(self, admit: bool = True) -> list:
        time.sleep(self.STEP_S)
        return super().step(admit)


def slow_decoding_maker(cfg, name: str, device):
    """``build_experience_maker``'s maker, streaming through ``SlowDecoding`` (``MakerWorker`` takes
    a maker's ``batcher_class``)."""
    maker = build_experience_maker(cfg, name=name, device=device)
    maker.batcher_class = SlowDecoding
    return maker


def holds_prompts(trainer: PPOTrainer, maker_id: int) -> bool:
    """True while the coordinator counts prompts handed to ``maker_id`` whose items have not come
    back: a streaming maker then has sequences waiting or running in its batcher."""
    return ray.get(trainer.coordinator.status.remote()).makers[maker_id].reserved > 0


@pytest.mark.parametrize("streaming", [False, True], ids=["batches", "streaming"])
def test_a_run_survives_a_killed_maker_and_trainer_worker_then_resumes_where_it_stopped(ray_session, tmp_path,
                                                                                       streaming):
    """One run takes two faults and is then resumed: the paths of three fits in two (each fit
    costs ~30 s of start-up on 2 cores).

    - maker_0 is killed (SIGKILL) once step 1 is seen: Ray restarts it (``maker.max_restarts``),
      it resyncs to the last push, and maker_1 runs on untouched.
    - rank 0 is killed once the checkpoint of step 3 (or 6) is published and a later step
      reported: the group restarts from that checkpoint and redoes the reported steps after it.
      (Killed once step 3 was merely seen, rank 0 could die inside step 4, before reporting it,
      with the maker's restart slowing the run: then no step ran twice, seen in CI.)
    - the run's last checkpoint, which fit() published to ``output_dir/checkpoint``, is resumed
      for 2 more steps: step, policy version and prompt position continue, no prompt twice.

    Streaming makers (``STREAMING``) take the maker's fault alone (the trainer's restart and the
    resume do not depend on the makers; ``tests/e2e/test_cli_resume.py`` resumes a streaming run
    after kill -9): maker_0 is killed while it holds prompts, its sequences running or waiting in
    its batcher; they are lost and served again, and pushes swap in while sequences run (decode
    steps slowed: ``SlowDecoding``).
    """
    base = ["maker.num_makers=2", "maker.max_restarts=2", "data.shuffle=false", *(STREAMING if streaming else ())]
    cfg = config(tmp_path, *base, "trainer.total_steps=8", "trainer.checkpoint_every=3")
    per_step = cfg.trainer.train_batch_size // cfg.maker.samples_per_prompt  # prompts trained at a step
    trainer = PPOTrainer(cfg, run_config=RunConfig(name="restart", storage_path=str(tmp_path / "ray_train"),
                                                   failure_config=FailureConfig(max_failures=1, controller_failure_limit=0)),
                         experience_maker_factory=slow_decoding_maker if streaming else None)
    killed = {}

    def kill_maker_0():
        killed["maker"] = ray.get(trainer.makers[0].ping.remote())
        killed["maker_at"] = time.monotonic()
        os.kill(killed["maker"], signal.SIGKILL)
        # what the dead process held: the coordinator counts it lost once Ray has restarted the maker
        killed["held"] = ray.get(trainer.coordinator.status.remote()).makers[0].reserved

    def kill_rank_0():
        killed["rank"] = ray.get(trainer.coordinator.status.remote()).rank_pids[0]
        os.kill(killed["rank"], signal.SIGKILL)

    if streaming:  # mid-stream: maker_0 has sequences waiting or running
        when(lambda: any(m["step"] >= 1 for m in list(trainer.history)) and holds_prompts(trainer, 0), kill_maker_0)
    else:
        when_step(trainer, 1, kill_maker_0)
        when(past_checkpoint(trainer, tmp_path, at_least=3), kill_rank_0)
    result = trainer.fit()
    steps = [m["step"] for m in trainer.history]
    versions = [m["policy_version"] for m in trainer.history]
    assert {"maker", *(() if streaming else ("rank",))} <= killed.keys()
    assert result.metrics["step"] == 8 and steps[-1] == 8
    if not streaming:
        assert len(steps) > len(set(steps))  # steps after the checkpoint ran again
    assert versions == sorted(versions)  # the makers never saw the policy version go backwards
    status = trainer.final_status
    # maker_0 came back once; the trainer's restart restarted no maker (nor the coordinator)
    assert status.makers[0].restarts == 1 and status.makers[1].restarts == 0
    assert trainer.history[-1]["weights_in_sync"] == 1.0  # the restarted maker resynced to the last push
    assert accounted(status)
    assert status.counters.lost_in_transit == 0  # inline transport: what a maker had sent is the coordinator's
    # served again: what the killed group trained after its checkpoint (streaming: what maker_0 held when killed)
    assert status.counters.prompts_requeued > 0
    kv_kept = sum(m.kv_kept for m in status.makers.values())
    spanning = sum(s.get("spanning_swaps", 0) for s in trainer.maker_summaries)
    print(f"maker kill: lost {status.counters.lost} prompts (held {killed['held']}); run finished "
          f"{time.monotonic() - killed['maker_at']:.1f} s after the kill; steps reported: {steps}; "
          f"swaps kept {kv_kept} running sequences' caches, {spanning} sequences spanned one")
    if streaming:
        # the prompts maker_0 was generating when it died were lost, and served again (trained once: below)
        assert killed["held"] > 0 and status.counters.lost > 0
        # pushes swapped in between two decode steps (maker.weight_updates=in_flight): the coordinator
        # counts the sequences a swap found running, over every maker process of the run, and the
        # makers' summaries the sequences that finished after one (maker_0's since its restart)
        assert kv_kept > 0 and spanning > 0
    # Exactly once: the final checkpoint's log holds each prompt once, over steps 1..8.
    saved = validate_checkpoint(tmp_path / "checkpoint")
    assert saved.step == 8
    trained = trained_ids(saved)
    assert len(trained) == 8 * per_step == len(set(trained))
    assert [s for s, _ in saved.data["trained"]] == list(range(1, 9))
    if streaming:
        return

    resumed = PPOTrainer(config(tmp_path, *base, "trainer.total_steps=10"), resume_from=tmp_path / "checkpoint")
    result = resumed.fit()
    assert [m["step"] for m in resumed.history] == [9, 10]
    assert [m["policy_version"] for m in resumed.history] == [saved.policy_version + 1, saved.policy_version + 2]
    # The resumed stream starts at the first prompt (file order: data.shuffle=false) not trained
    # by the checkpoint: prompts are read in file order (Ray Data's preserve_order), so this
    # holds on every run, not only when Ray Data happens to keep the blocks in order.
    assert trainer.final_status.data["first_prompt"] == PROMPTS[0]
    assert resumed.final_status.data["first_prompt"] == PROMPTS[saved.data["watermark"]]
    with result.checkpoint.as_directory() as directory:
        trained = trained_ids(validate_checkpoint(directory))
    assert len(trained) == 10 * per_step == len(set(trained))  # across the resume: no prompt trained twice
    assert resumed.history[-1]["weights_in_sync"] == 1.0


def test_a_run_that_fails_mid_batch_ends_with_its_error_and_no_line_per_killed_maker_call(ray_session, tmp_path, capfd):
    """The run fails (no batch within trainer.pull_timeout_s) while its maker makes its first
    batch, so fit() kills the maker with its loop calls under way. Ray retries a call to a killed
    actor that may restart and prints a line for each ("Task MakerWorker.send_loop failed. There
    are infinite retries remaining ... killed by `ray.kill`"): the run's error is all there is."""
    stuck = functools.partial(WaitingExperienceMaker, waits=(600.0,))  # its first batch outlasts the run
    trainer = PPOTrainer(config(tmp_path, "trainer.total_steps=2", "maker.num_makers=1", "trainer.pull_timeout_s=5"),
                         experience_maker_factory=stuck)
    with pytest.raises(Exception, match=r"no complete batch for 5 s .*makers alive 1/1"):
        trainer.fit()
    time.sleep(3)  # Ray's driver prints what it is told from a thread of its own
    printed = "".join(capfd.readouterr())
    # the kills at this run's end are ray.kill's (a maker an earlier test killed with SIGKILL may be named)
    assert "killed by `ray.kill`" not in printed, printed


def test_killed_coordinator_fails_the_run_clearly(ray_session, tmp_path):
    trainer = PPOTrainer(config(tmp_path, "trainer.total_steps=200", "maker.num_makers=1"))
    when_step(trainer, 2, lambda: ray.kill(trainer.coordinator, no_restart=True))
    start = time.monotonic()
    with pytest.raises(Exception, match="coordinator actor died.*--resume"):
        trainer.fit()
    assert time.monotonic() - start < 120
    assert trainer.namespace not in {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}

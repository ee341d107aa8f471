"""Checkpoint files: round trip, corrupt or truncated files, no unpickling, interrupted saves."""

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from ray_ppo.algo import make_kl_controller
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.train.checkpoint import (
    CheckpointError,
    RunState,
    load_trainer_state,
    publish_checkpoint,
    validate_checkpoint,
    write_trainer_state,
)


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    actor = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    critic = {"v": torch.randn(5)}
    optim = {"actor": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]},
             "generator": torch.Generator().manual_seed(1).get_state()}
    write_trainer_state(directory, actor, critic, optim,
                        RunState(step=7, policy_version=7, data={"epoch": 0, "position": 96}))
    return directory, actor, critic, optim


def test_round_trip(checkpoint):
    directory, actor, critic, optim = checkpoint
    assert validate_checkpoint(directory).step == 7
    a, c, o, state = load_trainer_state(directory)
    assert a.keys() == actor.keys() and all(torch.equal(a[k], actor[k]) and a[k].dtype == actor[k].dtype for k in a)
    assert torch.equal(c["v"], critic["v"])
    assert torch.equal(o["actor"]["state"][0]["exp_avg"], torch.ones(2)) and torch.equal(o["generator"], optim["generator"])
    assert state.data == {"epoch": 0, "position": 96} and state.policy_version == 7


@pytest.mark.parametrize("name", ["trainer/actor.safetensors", "trainer/critic.safetensors", "trainer/optimizer.pt"])
def test_truncated_file_is_a_clear_error(checkpoint, name):
    directory = checkpoint[0]
    path = directory / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{path}.*corrupt or truncated"):
        validate_checkpoint(directory)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_trainer_state(directory)


def test_missing_file_and_bad_state(checkpoint):
    directory = checkpoint[0]
    (directory / "trainer" / "critic.safetensors").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing trainer/critic.safetensors"):
        validate_checkpoint(directory)
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(directory / "nope")


def test_corrupt_state_json(checkpoint):
    directory = checkpoint[0]
    (directory / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="state.json is corrupt"):
        validate_checkpoint(directory)


class Payload:
    """An arbitrary object: unpickling it would run code chosen by whoever wrote the file."""


def test_optimizer_file_is_never_unpickled(checkpoint):
    directory = checkpoint[0]
    torch.save({"actor": Payload()}, directory / "trainer" / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        validate_checkpoint(directory)


def test_interrupted_save_keeps_the_previous_checkpoint(checkpoint, tmp_path, monkeypatch):
    directory = checkpoint[0]
    run = tmp_path / "run"
    publish_checkpoint(directory, run, step=7)
    assert validate_checkpoint(run / "checkpoint").step == 7

    real_copy2 = shutil.copy2
    copied = []

    def crash_midway(src, dst, *args, **kwargs):  # the process dies after copying one file
        if copied:
            raise OSError("simulated crash while copying")
        copied.append(src)
        return real_copy2(src, dst, *args, **kwargs)

    real_copytree = shutil.copytree

    def copytree(src, dst, *args, **kwargs):
        return real_copytree(src, dst, copy_function=crash_midway, dirs_exist_ok=kwargs.get("dirs_exist_ok", False))

    monkeypatch.setattr(shutil, "copytree", copytree)
    with pytest.raises(OSError, match="simulated crash"):
        publish_checkpoint(directory, run, step=8)
    monkeypatch.undo()
    assert validate_checkpoint(run / "checkpoint").step == 7  # still the previous complete one
    assert os.readlink(run / "checkpoint") == os.path.join("checkpoints", "step_00000007")
    publish_checkpoint(directory, run, step=9)  # a later save succeeds and replaces it
    assert os.readlink(run / "checkpoint") == os.path.join("checkpoints", "step_00000009")


def test_a_full_disk_leaves_the_previous_checkpoint_intact(checkpoint, tmp_path, monkeypatch):
    """The write of step 8 hits ENOSPC on its second file: step 7 stays linked and loadable,
    and no partial copy is left behind to fill the disk further."""
    import errno

    import ray_ppo.train.checkpoint as ckpt

    directory = checkpoint[0]
    run = tmp_path / "run"
    publish_checkpoint(directory, run, step=7)
    written = []

    def disk_full(src, dst):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        written.append(dst)
        shutil.copy2(src, dst)

    monkeypatch.setattr(ckpt, "_link_or_copy", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        publish_checkpoint(directory, run, step=8)
    monkeypatch.undo()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000007"]
    assert validate_checkpoint(run / "checkpoint").step == 7
    assert load_trainer_state(run / "checkpoint")[0]["w"].shape == (4, 3)


def test_retention_keeps_the_newest_and_publishing_is_idempotent(checkpoint, tmp_path):
    directory = checkpoint[0]
    run = tmp_path / "run"
    for step in (3, 6, 9, 12):
        publish_checkpoint(directory, run, step=step, keep=3)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000006", "step_00000009", "step_00000012"]
    publish_checkpoint(directory, run, step=12, keep=3)  # the same checkpoint again: nothing changes
    assert os.readlink(run / "checkpoint") == os.path.join("checkpoints", "step_00000012")
    publish_checkpoint(directory, run, step=15, keep=1)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000015"]
    # hard links: the published files share their bytes with the source (no second copy on disk)
    assert os.stat(run / "checkpoint" / "state.json").st_ino == os.stat(directory / "state.json").st_ino


def test_a_full_disk_on_the_trainer_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """Rank 0 writes a checkpoint into a temporary directory first: ENOSPC there removes it and
    ends the run with a line that says the previous checkpoint is intact."""
    import errno
    import tempfile
    from pathlib import Path

    import ray_ppo.train.checkpoint as checkpoint_module
    from ray_ppo.config import load_config
    from ray_ppo.models.build import build_actor, build_critic
    from ray_ppo.models.sync import join_state

    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    state = join_state(build_actor(cfg).state_dict(), build_critic(cfg).state_dict())

    def disk_full(directory, *args):
        (directory / "trainer").mkdir()
        (directory / "trainer" / "actor.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "write_trainer_state", disk_full)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(OSError, match=r"the checkpoint of step 3 could not be written \(\[Errno 28\] No space left "
                                      r"on device\); RUN_DIR/checkpoint still holds the previous one"):
        checkpoint_module.CheckpointWriter(cfg).write(state, {}, RunState(step=3, policy_version=3))
    assert list(tmp_path.iterdir()) == []


def test_critic_free_checkpoint_round_trip(tmp_path):
    """A critic-free run (algo.advantage=grpo, rloo, reinforce_pp) writes and reads no critic."""
    directory = tmp_path / "ckpt"
    write_trainer_state(directory, {"w": torch.ones(2)}, None, {"actor": {}}, RunState(step=3, policy_version=3))
    assert not (directory / "trainer" / "critic.safetensors").exists()
    assert validate_checkpoint(directory).has_critic is False
    actor, critic, _, state = load_trainer_state(directory)
    assert critic is None and torch.equal(actor["w"], torch.ones(2)) and state.step == 3


STATE_JSON_BEFORE_RUN_STATE = """{
  "format": 1,
  "has_critic": true,
  "step": 2,
  "policy_version": 2,
  "kl_ctl": {
    "value": 0.04,
    "target": 6.0,
    "horizon": 10000
  },
  "data": {
    "num_prompts": 8,
    "shuffle": true,
    "seed": 3,
    "epoch": 0,
    "watermark": 3,
    "next": 6,
    "done": [],
    "trained": [
      [
        1,
        [
          6,
          7
        ]
      ],
      [
        2,
        [
          2
        ]
      ]
    ],
    "counts": {
      "taken": 6,
      "blank": 0,
      "truncated": 0,
      "lost": 0,
      "requeued": 0,
      "trained": 3
    },
    "first_prompt": "prompt 6"
  }
}"""
"""``state.json`` as the loop wrote it when the run state was a dict: step 2 of a run with an
adaptive KL controller, 8 shuffled prompts (seed 3), prompts 6, 7 and 2 trained, 1, 4 and 5 in flight."""


def test_a_checkpoint_written_before_run_state_loads_resumes_and_is_written_the_same(tmp_path):
    old = tmp_path / "old"
    (old / "trainer").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(old / "trainer" / "actor.safetensors"))
    save_file({"v": torch.ones(1)}, str(old / "trainer" / "critic.safetensors"))
    torch.save({"actor": {}}, old / "trainer" / "optimizer.pt")
    (old / "state.json").write_text(STATE_JSON_BEFORE_RUN_STATE)

    restored = load_trainer_state(old)
    assert (restored.run.step, restored.run.policy_version, restored.run.has_critic) == (2, 2, True)
    kl_ctl = make_kl_controller(0.05, 6.0, 10000)
    kl_ctl.load_state_dict(restored.run.kl_ctl)  # as the loop resumes it
    assert kl_ctl.value == 0.04
    ledger = PromptLedger(shuffle=False, seed=0, start=restored.run.data)  # as the coordinator resumes it
    ledger.configure(8)
    assert ledger.take(4, maker_id=0) == [1, 4, 5, 3]  # the prompts in flight first, then the stream goes on
    new = tmp_path / "new"
    write_trainer_state(new, restored.actor, restored.critic, restored.optimizer, restored.run)
    assert (new / "state.json").read_text() == STATE_JSON_BEFORE_RUN_STATE

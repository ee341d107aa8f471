"""Run directories: never clobbered, nothing half-written, clear resume messages (no Ray)."""

import pytest
import torch

from ray_ppo.outputs.rundir import (
    CheckpointPublisher,
    RunDirError,
    claim_run_dir,
    nothing_to_do,
    resume_point,
    resuming_line,
    stopped_line,
)
from ray_ppo.train.checkpoint import RunState, publish_checkpoint, write_trainer_state


def old_run(path):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("name: old\n")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def test_an_existing_run_is_refused_with_what_to_do(tmp_path):
    run = old_run(tmp_path / "run")
    with pytest.raises(RunDirError) as e:
        claim_run_dir(run)
    # a run without a checkpoint cannot be resumed, so that is not offered
    assert str(e.value) == (f"run directory {run} already holds a run (config.yaml, metrics.jsonl); it wrote no "
                            f"checkpoint to continue from; replace it with --overwrite, or give another --output")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    (run / "checkpoint").mkdir()
    with pytest.raises(RunDirError, match=f"; continue it with --resume {run}, replace it with --overwrite, or give"):
        claim_run_dir(run)


def test_a_new_run_that_fails_before_its_first_step_leaves_nothing(tmp_path):
    claim = claim_run_dir(tmp_path / "new")
    (tmp_path / "new" / "config.yaml").write_text("name: new\n")
    claim.release()
    assert not (tmp_path / "new").exists()
    claim = claim_run_dir(tmp_path / "new")  # an empty directory is free to use, and kept once started
    claim.started({"step": 1})
    claim.release()
    assert (tmp_path / "new").is_dir()


def test_overwrite_replaces_the_old_run_only_once_the_new_one_has_a_step(tmp_path):
    run = old_run(tmp_path / "run")
    claim = claim_run_dir(run, overwrite=True)
    assert list(run.iterdir()) == []
    (run / "config.yaml").write_text("name: new\n")
    claim.release()  # failed before its first step: the old run is back, as it was
    assert (run / "config.yaml").read_text() == "name: old\n" and (run / "metrics.jsonl").exists()
    claim = claim_run_dir(run, overwrite=True)
    (run / "config.yaml").write_text("name: new\n")
    claim.started({"step": 1})
    claim.release()
    assert [p.name for p in run.iterdir()] == ["config.yaml"] and (run / "config.yaml").read_text() == "name: new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # the set-aside copy is gone


def test_resume_messages(tmp_path):
    with pytest.raises(RunDirError, match="not a run directory"):
        resume_point(tmp_path / "nowhere")
    run = old_run(tmp_path / "run")
    with pytest.raises(RunDirError, match="wrote no checkpoint before it stopped .*trainer.checkpoint_every"):
        resume_point(run)
    assert stopped_line("train", run, 3) == ("ray-ppo train: interrupted after step 3; no checkpoint was written "
                                             "(trainer.checkpoint_every=0?), nothing to resume")
    ckpt = tmp_path / "ckpt"
    write_trainer_state(ckpt, {"w": torch.zeros(1)}, {"v": torch.zeros(1)}, {}, RunState(step=4, policy_version=4))
    publish_checkpoint(ckpt, run, step=4)
    directory, state = resume_point(run)
    assert directory == run / "checkpoint" and state.step == 4
    assert resuming_line(run, 4, directory) == f"resuming {run} from step 4 (checkpoint {run}/checkpoints/step_00000004)"
    assert stopped_line("train", run, 5) == (f"ray-ppo train: interrupted after step 5; {run}/checkpoint holds step 4: "
                                             f"resume with: ray-ppo train --resume {run}")
    assert nothing_to_do(run, 4, 10) is None
    assert nothing_to_do(run, 4, 4) == (f"run {run} has already trained 4 steps (trainer.total_steps=4): nothing to do; "
                                        f"to train further: ray-ppo train --resume {run} trainer.total_steps=8")


def test_a_resume_touches_the_run_record_only_from_its_first_step(tmp_path):
    """A resume that ends before its first step (kill -9: no flush, no close) leaves config.yaml
    and metrics.jsonl as they were; at its first step the rows after the checkpoint are dropped
    in one rename and the new rows appended."""
    from ray_ppo.config import Config
    from ray_ppo.outputs.tracking import RunDirectory, read_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("# the first run's config\n")
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))
    RunDirectory(run, Config().with_overrides({"name": "resumed"}), resume_after_step=3)  # never used, as if killed
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert (run / "config.yaml").read_text() == "# the first run's config\n"

    resumed = RunDirectory(run, Config().with_overrides({"name": "resumed"}), resume_after_step=3)
    resumed({"step": 4, "reward_mean": 0.5})
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert "resumed" in (run / "config.yaml").read_text()
    resumed.close()


class _Stored:
    """A ``ray.train.Checkpoint`` stand-in: a directory Ray Train stored."""

    def __init__(self, path):
        self.path = path

    def as_directory(self):
        import contextlib

        return contextlib.nullcontext(self.path)


def test_the_first_checkpoint_published_says_its_size(tmp_path, capsys):
    run = old_run(tmp_path / "run")
    stored = []
    for step in (2, 4):
        stored.append(tmp_path / f"stored_{step}")
        write_trainer_state(stored[-1], {"w": torch.zeros(250_000)}, None, {}, RunState(step=step, policy_version=step))
    publisher = CheckpointPublisher(coordinator=None, run_dir=run, keep=2)
    for step, path in zip((2, 4), stored):
        publisher.publish(step, _Stored(path))
    size = sum(f.stat().st_size for f in (run / "checkpoints" / "step_00000002").rglob("*") if f.is_file())
    assert 1.0e6 < size < 1.1e6  # 250 000 float32 weights and the state
    assert capsys.readouterr().out == (f"checkpoint of step 2: {size / 1e6:.1f} MB in {run}/checkpoints, up to 2 kept "
                                       f"(trainer.keep_checkpoints=2)\n")  # once, for the first
    assert publisher.published_step == 4

"""A run directory written by 30ca318 (before the layout by role: ``tests/fixtures/run_30ca318``,
two steps of ``configs/tiny.yaml``) is read by today's code as that code wrote it. The e2e test
``tests/e2e/test_cli_resume.py::test_a_run_dir_of_30ca318_resumes`` trains a step on from it."""

import json
from pathlib import Path

from ray_ppo.config import load_config
from ray_ppo.outputs.rundir import resume_point
from ray_ppo.train.checkpoint import load_trainer_state, validate_checkpoint

OLD_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "run_30ca318"


def test_its_config_checkpoint_and_state_load():
    cfg = load_config(OLD_RUN / "config.yaml")
    assert cfg.model.pretrained == "tiny" and cfg.model.reward_fn == "ray_ppo.tasks.toy:reward"
    run_state = validate_checkpoint(OLD_RUN / "checkpoint")
    assert run_state.step == 2 and run_state.policy_version == 2
    trainer = load_trainer_state(OLD_RUN / "checkpoint")
    assert trainer.actor and trainer.critic  # a GAE run: both models' weights
    assert trainer.run.data["trained"] and trainer.run.data["next"] == 12  # the prompt ledger's place
    rows = [json.loads(line) for line in (OLD_RUN / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]


def test_its_run_directory_resumes_from_its_last_checkpoint():
    checkpoint, run_state = resume_point(OLD_RUN)
    assert checkpoint.resolve().name == "step_00000002" and run_state.step == 2

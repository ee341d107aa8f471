"""Evaluation during a detached run (``eval``): the makers evaluate the base model, every
``eval.every`` steps and the last step's weights; the reports reach eval.jsonl, the metrics rows
and the run's result."""

from pathlib import Path

import pytest

from ray_ppo.api import PPOTrainer
from ray_ppo.config import load_config
from ray_ppo.outputs.evals import read_evals

pytestmark = pytest.mark.ray

REPO = Path(__file__).parents[2]
STEPS = 5


def test_makers_evaluate_steps_0_every_2_and_the_last(ray_session, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"trainer.total_steps={STEPS}", "trainer.train_batch_size=16", "trainer.mini_batch_size=8",
        "maker.num_makers=2", "maker.batch_size=8", "logging.report_every=1",
        f"eval.path={REPO / 'data' / 'toy_prompts.csv'}", "eval.every=2", "eval.num_prompts=12"])
    trainer = PPOTrainer(cfg, output_dir=tmp_path)  # writes the run files the CLI writes
    result = trainer.fit()

    reports = read_evals(tmp_path)
    assert [r["step"] for r in reports] == [0, 2, 4, 5]  # in the order they were asked for
    assert all(r["error"] is None and r["num_prompts"] == 12 for r in reports), reports
    assert {r["maker_id"] for r in reports} == {0, 1}  # the makers take turns
    # A maker evaluates the push of the step asked for once it holds it (or a later one, if it came first).
    assert all(r["policy_version"] >= r["step"] for r in reports)
    assert reports[-1]["policy_version"] == trainer.history[-1]["policy_version"] == STEPS
    # The last row waited for the last step's evaluation; Ray Train's result carries its figures.
    assert trainer.history[-1]["eval/step"] == STEPS and result.metrics["eval/step"] == STEPS
    assert result.metrics["eval/accuracy"] == reports[-1]["accuracy"]
    seen = sorted(row["eval/step"] for row in trainer.history if "eval/step" in row)
    assert seen[-1] == STEPS and set(seen) <= {0, 2, 4, 5}
    assert "evals" not in trainer.history[-1]

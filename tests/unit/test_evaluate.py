"""``ray-ppo eval`` / ``ray_ppo.evaluate``: a model, checkpoint or run scored on a prompt file (no Ray)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ray_ppo.cli import main
from ray_ppo.config import load_config
from ray_ppo.evaluate import _result, evaluate, resolve_model
from ray_ppo.tasks import toy

REPO = Path(__file__).parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
PROMPTS = str(REPO / "data" / "toy_prompts.csv")


def test_eval_prints_accuracy_and_samples_and_writes_json(tiny_path, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "tiny", "--config", TINY, "--data", PROMPTS, "--num-prompts", "8", "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("eval: accuracy ") and "(" in lines[-1] and "/8 responses) | reward " in lines[-1]
    assert "| greedy | model tiny | data " in lines[-1]
    assert sum(line.startswith("  prompt ") for line in lines) == 3
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 8 and result["greedy"] and len(result["samples"]) == 3
    for sample in result["samples"]:  # each shown reward is the task's reward of that response
        assert toy.reward([sample["prompt"]], [sample["response"]]) == [sample["reward"]]
    assert 0 <= result["accuracy"] <= result["pass_at_k"] <= 1


def test_greedy_evaluation_is_repeatable_and_a_run_directory_means_its_latest_actor(tiny_path, tmp_path):
    cfg = load_config(TINY)
    run = tmp_path / "run"
    shutil.copytree(tiny_path, run / "checkpoints" / "step_00000002" / "actor")
    (run / "checkpoint").symlink_to(run / "checkpoints" / "step_00000002")
    assert resolve_model(str(run)) == str((run / "checkpoint" / "actor").resolve())
    assert resolve_model(str(run / "checkpoint")) == str((run / "checkpoint" / "actor").resolve())
    first = evaluate(cfg, str(run), PROMPTS, num_prompts=6)
    base = evaluate(cfg, "tiny", PROMPTS, num_prompts=6)  # the run's actor is a copy of the tiny model
    assert first.model == str(run) and (first.accuracy, first.samples) == (base.accuracy, base.samples)
    assert first == evaluate(cfg, str(run), PROMPTS, num_prompts=6)


def test_sampled_evaluation_reports_mean_and_pass_at_k(tiny_path):
    result = evaluate(load_config(TINY), "tiny", PROMPTS, num_prompts=4, samples_per_prompt=3, greedy=False)
    assert (result.num_prompts, result.samples_per_prompt, result.greedy) == (4, 3, False)
    assert "| sampled, k=3, pass@3 " in result.line()


def test_accuracy_counts_responses_and_pass_at_k_counts_prompts():
    rows = [("a", "r", 1.0), ("a", "r", 0.0), ("b", "r", 0.0), ("b", "r", 0.5)]
    result = _result(rows, "m", "d", k=2, greedy=False)
    assert (result.accuracy, result.pass_at_k, result.reward_mean) == (0.25, 0.5, 0.375)


def test_bad_eval_options_are_one_line(capsys):
    assert main(["eval", "tiny", "--config", TINY, "--data", PROMPTS, "--samples", "0"]) == 2
    assert capsys.readouterr().err.strip() == "ray-ppo eval: error: --samples must be > 0, got 0"
    with pytest.raises(ValueError, match="greedy evaluation gives one response a prompt"):
        evaluate(load_config(TINY), "tiny", PROMPTS, samples_per_prompt=2, greedy=True)

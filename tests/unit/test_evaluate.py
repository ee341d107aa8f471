"""``ray-ppo eval`` / ``ray_ppo.makers.evaluation``: a model, checkpoint or run scored on a prompt file (no Ray)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ray_ppo.cli import main
from ray_ppo.config import load_config
from ray_ppo.makers.evaluation import _result, evaluate, resolve_model
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


def _fake_run(tiny_path, tmp_path: Path, config: str) -> Path:
    """A run directory as `ray-ppo train` leaves it: config.yaml, metrics.jsonl and a checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(tiny_path, run / "checkpoints" / "step_00000002" / "actor")
    (run / "checkpoint").symlink_to(run / "checkpoints" / "step_00000002")
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


RUN_CONFIG = f"""model:
  pretrained: tiny
  reward_fn: ray_ppo.tasks.toy:reward
maker:
  max_new_tokens: 3
eval:
  path: {PROMPTS}
  num_prompts: 5
  max_new_tokens: 6
"""


def test_eval_of_a_run_directory_reads_the_runs_config(tiny_path, tmp_path, capsys):
    """`ray-ppo eval RUN_DIR` scores as the run's own evaluation did: its reward, its eval file,
    prompt count and answer length; it says which it used (before: the defaults, silently)."""
    run = _fake_run(tiny_path, tmp_path, RUN_CONFIG)
    assert main(["eval", str(run), "--output", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"eval: model {run} (") and f"config {run / 'config.yaml'}" in out[0]
    assert f"prompts first 5 of {PROMPTS}" in out[0] and "reward ray_ppo.tasks.toy:reward" in out[0]
    assert "greedy, max_new_tokens 6" in out[0]
    result = json.loads((tmp_path / "e.json").read_text())
    cfg = load_config(run / "config.yaml")
    expected = evaluate(cfg, str(run), PROMPTS, num_prompts=5, max_new_tokens=6)
    assert (result["num_prompts"], result["accuracy"], result["reward_mean"]) == (5, expected.accuracy,
                                                                                  expected.reward_mean)
    # a checkpoint of the run finds the run's config too; --config and overrides win over it
    from ray_ppo.makers.evaluation import EvalSetup

    assert EvalSetup.of(str(run / "checkpoints" / "step_00000002")).config_file == str(run / "config.yaml")
    setup = EvalSetup.of(str(run), TINY, ["maker.max_new_tokens=2"], num_prompts=3, samples=2)
    assert (setup.config_file, setup.max_new_tokens, setup.num_prompts, setup.greedy, setup.samples_per_prompt) == (
        TINY, 2, 3, False, 2)


@pytest.mark.parametrize("case", ["no_module", "no_dir", "run_without_checkpoint", "not_a_model", "no_data"])
def test_eval_errors_are_one_line_with_status_2(case, tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = {"no_module": ["tiny", "--data", PROMPTS, "model.reward_fn=fruit_reward:reward"],
            "no_dir": ["./no_such_dir", "--data", PROMPTS],
            "run_without_checkpoint": [str(tmp_path / "run"), "--data", PROMPTS],
            "not_a_model": [str(tmp_path), "--data", PROMPTS],
            "no_data": ["tiny", "--data", "missing.csv"]}[case]
    if case == "run_without_checkpoint":
        shutil.rmtree(_fake_run(tiny_path, tmp_path, RUN_CONFIG) / "checkpoints")
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("ray-ppo eval: error: ") and "Traceback" not in err
    assert {"no_module": "no module named 'fruit_reward'", "no_dir": "'./no_such_dir' does not exist",
            "run_without_checkpoint": "is a run directory without a checkpoint",
            "not_a_model": "is not a model", "no_data": "'missing.csv' does not exist"}[case] in err


def test_eval_with_an_environment_runs_its_preflight_probe_and_answers_in_episodes(tiny_path, capsys):
    """Pre-flight's probe episode (``check_env``) runs for ``ray-ppo eval`` as for ``train``."""
    assert main(["eval", "tiny", "--config", TINY, "--data", PROMPTS, "--num-prompts", "4",
                 "env.cls=ray_ppo.tasks.turns:TwoTurnEnv", "env.max_tokens=32"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("eval: accuracy ")


def test_eval_resolves_its_model_once(tiny_path, monkeypatch, capsys):
    """Resolving a packaged or GGUF model hashes its file: `ray-ppo eval` does it once, for the
    checks, its first line and the evaluation alike."""
    import ray_ppo.makers.evaluation as evaluate_module

    calls, real = [], evaluate_module.resolve_model
    monkeypatch.setattr(evaluate_module, "resolve_model", lambda model: calls.append(model) or real(model))
    assert main(["eval", "tiny", "--config", TINY, "--data", PROMPTS, "--num-prompts", "2"]) == 0
    assert calls == ["tiny"]


def test_a_streaming_makers_evaluation_answers_through_its_batcher_as_batch_generation_does(tiny_path, monkeypatch):
    """maker.max_running > 0: evaluation takes the engine path experience takes (one stream of
    every prompt), and greedy answers are those of batch-by-batch generation."""
    from ray_ppo.models import continuous

    streamed = []
    run = continuous.ContinuousBatcher.run
    monkeypatch.setattr(continuous.ContinuousBatcher, "run",
                        lambda self, requests: streamed.append(self.max_running) or run(self, requests))
    cfg = load_config(TINY)
    batch = evaluate(cfg, "tiny", PROMPTS, num_prompts=12)
    assert streamed == []
    stream = evaluate(cfg.with_overrides({"maker.max_running": 4}), "tiny", PROMPTS, num_prompts=12)
    assert streamed == [4]  # the 12 prompts in one stream of 4 slots, whatever maker.batch_size is
    assert (stream.accuracy, stream.reward_mean, stream.samples) == (batch.accuracy, batch.reward_mean, batch.samples)


def test_a_streaming_makers_episodes_are_evaluated_turn_by_turn_as_in_a_batch(tiny_path, monkeypatch):
    """maker.max_running with env.cls: every evaluation episode streams through one batcher
    (``EpisodeStream``), each turn a request; greedy episodes end as batch-by-batch episodes do."""
    from ray_ppo.makers import episodes

    streams = []
    run = episodes.EpisodeStream.run
    monkeypatch.setattr(episodes.EpisodeStream, "run",
                        lambda self, batcher, ids, prompts: streams.append((batcher.max_running, len(ids)))
                        or run(self, batcher, ids, prompts))
    cfg = load_config(TINY).with_overrides({"env.cls": "ray_ppo.tasks.turns:TwoTurnEnv", "env.max_tokens": 32})
    batch = evaluate(cfg, "tiny", PROMPTS, num_prompts=10)
    stream = evaluate(cfg.with_overrides({"maker.max_running": 4}), "tiny", PROMPTS, num_prompts=10)
    assert streams == [(4, 10)]
    assert (stream.accuracy, stream.reward_mean, stream.samples) == (batch.accuracy, batch.reward_mean, batch.samples)
    assert all(len(s["response"]) > 0 for s in stream.samples)


def test_an_agent_is_evaluated_through_its_endpoint_as_its_environment_twin_is(tiny_model_cache, capsys):
    """agent.fn: evaluation runs the agent against the endpoint (``ray_ppo.tasks.turns.two_turn_agent``,
    the agent twin of ``TwoTurnEnv``); greedy, its episodes are token for token the environment's,
    so the scores match. ``ray-ppo eval`` runs it too."""
    chat = {"model.pretrained": "tiny-chat", "data.chat_template": True, "maker.max_running": 4, "env.max_tokens": 32}
    cfg = load_config(TINY).with_overrides(chat)
    env = evaluate(cfg.with_overrides({"env.cls": "ray_ppo.tasks.turns:TwoTurnEnv"}), "tiny-chat", PROMPTS, num_prompts=8)
    agent = evaluate(cfg.with_overrides({"agent.fn": "ray_ppo.tasks.turns:two_turn_agent"}), "tiny-chat", PROMPTS,
                     num_prompts=8)
    assert (agent.accuracy, agent.reward_mean, agent.samples) == (env.accuracy, env.reward_mean, env.samples)
    assert agent.reward_mean > 0
    assert main(["eval", "tiny-chat", "--config", TINY, "--data", PROMPTS, "--num-prompts", "4",
                 *(f"{k}={v}" for k, v in chat.items()), "agent.fn=ray_ppo.tasks.turns:two_turn_agent"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("eval: accuracy ")

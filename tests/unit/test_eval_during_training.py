"""Evaluation during training (the ``eval`` section), without Ray: its settings, the coordinator's
turns among makers, the rows and files its reports reach, and the local loop's evaluations.
A run with makers and a trainer is in ``tests/ray/test_eval_in_a_run.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ray_ppo.config import Config, ConfigError, load_config
from ray_ppo.coordinator.actor import Coordinator
from ray_ppo.local import run_local
from ray_ppo.makers.testing import coordinator_config
from ray_ppo.outputs.evals import EVALS_KEY, EvalReport, attach_evals, eval_line, eval_summary, read_evals, split_evals
from ray_ppo.outputs.tracking import LiveLine, RunDirectory

REPO = Path(__file__).parents[2]
PROMPTS = str(REPO / "data" / "toy_prompts.csv")


def report(step: int, accuracy: float = 0.5, **kwargs) -> EvalReport:
    return EvalReport(step=step, policy_version=step, maker_id=0, eval_s=2.0, accuracy=accuracy,
                      reward_mean=accuracy, num_prompts=10, samples=({"prompt": "p", "response": "r", "reward": 1.0},),
                      **kwargs)


# -- settings -------------------------------------------------------------------------------------


def test_evaluation_is_due_at_step_0_every_n_steps_and_at_the_last_step():
    e = Config.from_dict({"eval": {"path": PROMPTS, "every": 4}}).eval
    assert [s for s in range(11) if e.due(s, last=s == 10)] == [0, 4, 8, 10]
    assert [s for s in range(7) if Config.from_dict({"eval": {"path": PROMPTS, "every": 0}}).eval.due(s, s == 6)] == [0, 6]
    assert not any(Config().eval.due(s, last=True) for s in range(3))  # no eval.path: never
    # A push every 4 steps: the first push at or after steps 10, 20, 30 (its weights reach the makers).
    pushes = range(4, 41, 4)
    assert [s for s in pushes if e.due(s, last=False, update_steps=4)] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    every_10 = Config.from_dict({"eval": {"path": PROMPTS, "every": 10}}).eval
    assert [s for s in pushes if every_10.due(s, last=s == 40, update_steps=4)] == [12, 20, 32, 40]


def test_bad_eval_settings_are_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match=r"^eval.greedy=true gives one response a prompt, not eval.samples_per_prompt=4; "
                                          r"set eval.greedy=false"):
        Config.from_dict({"eval": {"samples_per_prompt": 4}})
    with pytest.raises(ConfigError, match=r"eval.reward_fn and model.reward_fn are null; set eval.reward_fn="):
        Config.from_dict({"eval": {"path": PROMPTS}, "model": {"reward_fn": None, "reward_pretrained": "r"}})
    cfg = Config.from_dict({"eval": {"path": PROMPTS, "reward_fn": "ray_ppo.tasks.arithmetic:reward"}})
    assert cfg.eval_reward_fn == "ray_ppo.tasks.arithmetic:reward"
    assert Config.from_dict({"eval": {"path": PROMPTS}}).eval_reward_fn == "ray_ppo.tasks.toy:reward"


# -- the coordinator ------------------------------------------------------------------------------


class EvalMaker:
    """A maker handle whose ``evaluate`` answers after ``delay_s`` (or raises ``error``)."""

    def __init__(self, maker_id: int, delay_s: float = 0.0, error: Exception | None = None):
        self.asked: list[tuple[int, int]] = []
        maker = self

        class Evaluate:
            @staticmethod
            def remote(step, version):
                maker.asked.append((step, version))

                async def answer():
                    await asyncio.sleep(delay_s)
                    if error is not None:
                        raise error
                    return EvalReport(step=step, policy_version=version, maker_id=maker_id)
                return answer()

        self.evaluate = Evaluate


def test_makers_take_turns_and_a_failed_evaluation_is_reported_not_raised():
    async def scenario():
        coord = Coordinator(coordinator_config(num_makers=3))
        makers = {0: EvalMaker(0, delay_s=0.05), 1: EvalMaker(1, error=TimeoutError("still holds v1")), 2: EvalMaker(2)}
        coord.register_makers(makers)
        coord.maker_failed(2, "dead")  # a failed maker is skipped
        for step in (0, 5, 10):
            coord.request_eval(step, step)
        await coord.evals_done()
        return makers, coord.evals_since(0), coord.evals_since(2)

    makers, reports, later = asyncio.run(scenario())
    assert makers[0].asked == [(0, 0), (10, 10)] and makers[1].asked == [(5, 5)] and makers[2].asked == []
    by_step = {r.step: r for r in reports}
    assert sorted(by_step) == [0, 5, 10]
    assert by_step[5].error == "TimeoutError: still holds v1" and by_step[5].metrics() == {}
    assert by_step[0].error is None and by_step[0].metrics()["eval/step"] == 0.0
    assert later == reports[2:]


# -- rows, files and lines ------------------------------------------------------------------------


def test_a_row_carries_its_reports_and_the_latest_figures():
    row = attach_evals({"step": 7, "reward_mean": 0.1}, [report(0, 0.25), report(5, 0.5), report(6, error="boom")])
    assert row["eval/accuracy"] == 0.5 and row["eval/step"] == 5.0 and "eval/pass_at_k" not in row
    plain, reports = split_evals(row)
    assert EVALS_KEY not in plain and [r["step"] for r in reports] == [0, 5, 6]
    assert attach_evals({"step": 1}, []) == {"step": 1}


def test_lines_and_summary():
    assert eval_line(split_evals(attach_evals({}, [report(10, 0.42)]))[1][0]) == \
        "eval step 10 (v10): accuracy 0.420 of 10 prompts, greedy | reward 0.420 | 2 s on maker_0"
    failed = EvalReport(step=3, maker_id=1, error="TimeoutError: x")
    assert eval_line(split_evals(attach_evals({}, [failed]))[1][0]) == "eval step 3 failed on maker_1: TimeoutError: x"
    reports = split_evals(attach_evals({}, [report(10, 0.42), report(0, 0.1), failed]))[1]
    assert eval_summary(reports) == "eval accuracy 0.100 (step 0) -> 0.420 (step 10)"
    assert eval_summary([]) == ""


def test_the_run_directory_writes_every_report_at_its_step_and_a_resume_redoes_the_later_ones(tmp_path):
    cfg = Config()
    run = RunDirectory(tmp_path, cfg, tensorboard=False)
    run(attach_evals({"step": 1, "reward_mean": 0.1}, [report(0, 0.1)]))
    run({"step": 2, "reward_mean": 0.2})
    run(attach_evals({"step": 3, "reward_mean": 0.3}, [report(2, 0.2), report(3, 0.3)]))
    run.close()
    assert [r["step"] for r in read_evals(tmp_path)] == [0, 2, 3]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("eval/accuracy") for r in rows] == [0.1, None, 0.3] and all(EVALS_KEY not in r for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["eval"]) for s in samples] == [(0, True), (2, True), (3, True)]
    resumed = RunDirectory(tmp_path, cfg, tensorboard=False, resume_after_step=2)
    resumed(attach_evals({"step": 3, "reward_mean": 0.3}, [report(3, 0.35)]))
    resumed.close()
    assert [(r["step"], r["accuracy"]) for r in read_evals(tmp_path)] == [(0, 0.1), (2, 0.2), (3, 0.35)]


def test_tensorboard_gets_each_evaluation_at_the_step_it_evaluated(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDirectory(tmp_path, Config(), tensorboard=True)
    run(attach_evals({"step": 3, "reward_mean": 0.3}, [report(0, 0.1), report(2, 0.2)]))
    run.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/accuracy")] == [(0, 0.1), (2, 0.2)]


def test_the_live_line_prints_one_line_per_evaluation(capsys):
    LiveLine(10)(attach_evals({"step": 3, "reward_mean": 0.3}, [report(0, 0.1)]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 3/10 | reward 0.300") and lines[1].startswith("eval step 0 (v0): accuracy 0.100")


# -- the local loop -------------------------------------------------------------------------------


def test_the_local_loop_evaluates_the_base_model_every_n_steps_and_the_last(tiny_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        "trainer.total_steps=5", "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "maker.batch_size=8",
        f"eval.path={PROMPTS}", "eval.every=2", "eval.num_prompts=6"])
    rows = []
    history = run_local(cfg, on_metrics=rows.append)
    reports = [r for row in rows for r in split_evals(row)[1]]
    assert [(r["step"], r["policy_version"]) for r in reports] == [(0, 0), (2, 2), (4, 4), (5, 5)]
    assert all(r["num_prompts"] == 6 and r["error"] is None and 0 <= r["accuracy"] <= 1 for r in reports)
    assert [row.get("eval/step") for row in history] == [0.0, 2.0, None, 4.0, 5.0]
    assert all(EVALS_KEY not in row for row in history)


def test_pre_flight_refuses_an_eval_file_it_cannot_use(tiny_path, tmp_path):
    from ray_ppo.config.preflight import PreflightError, check_run

    base = load_config(REPO / "configs" / "tiny.yaml")
    with pytest.raises(PreflightError, match=r"^eval.path='.*missing.jsonl' does not exist"):
        check_run(base.with_overrides({"eval.path": str(tmp_path / "missing.jsonl")}))
    (tmp_path / "other.csv").write_text("question\nwhat\n")
    with pytest.raises(PreflightError, match=r"data.prompt_column='prompt' is not a column of .*other.csv"):
        check_run(base.with_overrides({"eval.path": str(tmp_path / "other.csv")}))
    with pytest.raises(PreflightError, match=r"^eval.reward_fn='ray_ppo.tasks.nope:reward' cannot be imported"):
        check_run(base.with_overrides({"eval.path": PROMPTS, "eval.reward_fn": "ray_ppo.tasks.nope:reward"}))
    check_run(base.with_overrides({"eval.path": PROMPTS}))

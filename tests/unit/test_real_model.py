"""The real-model comparison's own logic (``benchmarks/real_model.py``, ``benchmarks/peer_trl_grpo.py``):
accuracy at a time, the time to reach an accuracy, issue 40's goal, reading both sides' run
directories, and the mapping of configs/smollm2_grpo.yaml onto TRL's GRPOConfig. No TRL needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peer_trl_grpo  # noqa: E402
import real_model  # noqa: E402
from real_model import Run  # noqa: E402

CURVE = [(0.0, 0, 0.5), (250.0, 10, 0.6), (520.0, 20, 0.7), (910.0, 31, 0.65)]


def test_at_takes_the_last_evaluation_at_or_before_the_time():
    assert [real_model.at(CURVE, s) for s in (0, 249.9, 250, 600, 900, 1e9)] == [0.5, 0.5, 0.6, 0.7, 0.7, 0.65]


def test_reach_s_is_the_first_evaluation_at_or_above_the_accuracy():
    assert real_model.reach_s(CURVE, 0.6) == 250.0
    assert real_model.reach_s(CURVE, 0.65) == 520.0  # the first, not the last one at 0.65
    assert real_model.reach_s(CURVE, 0.5) == 0.0
    assert real_model.reach_s(CURVE, 0.71) == float("inf")


def test_goal_compares_medians_over_seeds():
    trl = [Run("trl", s, [(0.0, 0, 0.5), (t, 30, acc)], sps) for s, t, acc, sps in
           ((0, 900.0, 0.6, 1.0), (1, 1000.0, 0.7, 2.0), (2, 800.0, 0.8, 3.0))]
    # target: median final accuracy 0.7; TRL's time: median 900 s; its samples/s: median 2.0
    ours = [Run("ours", s, [(0.0, 0, 0.5), (t, 10, 0.7)], 2.4) for s, t in ((0, 600.0), (1, 675.0), (2, 800.0))]
    g = real_model.goal(ours, trl)
    assert (g.target, g.trl_s, g.ours_s, g.speed_ratio) == (0.7, 900.0, 675.0, pytest.approx(1.2))
    assert g.met  # 675 = 0.75 x 900, and 2.4 = 1.2 x 2.0: both bounds inclusive
    assert "met" in g.line() and "675 s = 0.75x" in g.line()


@pytest.mark.parametrize("change", ["slower", "never", "fewer samples/s"])
def test_goal_is_missed_when_either_bound_fails(change):
    trl = [Run("trl", 0, [(0.0, 0, 0.5), (900.0, 30, 0.7)], 2.0)]
    reach_s, final, sps = {"slower": (700.0, 0.7, 2.4), "never": (100.0, 0.69, 2.4),
                           "fewer samples/s": (600.0, 0.7, 2.3)}[change]
    g = real_model.goal([Run("ours", 0, [(0.0, 0, 0.5), (reach_s, 10, final)], sps)], trl)
    assert not g.met and "missed" in g.line()
    if change == "never":
        assert g.ours_s == float("inf") and "reaches it at never" in g.line()


def test_reach_lines_give_each_group_s_median_time_and_its_ratio_to_the_first():
    run = lambda seed, t: Run("ours", seed, [(0.0, 0, 0.5), (t, 10, 0.8)], 1.0)  # noqa: E731
    never = Run("ours", 9, [(0.0, 0, 0.5), (900.0, 70, 0.7)], 1.0)
    base = [run(0, 400.0), run(1, 500.0), run(2, 900.0)]
    lines = real_model.reach_lines({"base": base, "option": [run(0, 200.0), never, run(2, 400.0)],
                                    "worse": [never, never, run(1, 100.0)]}, 0.75)
    assert lines == ["base: reaches 0.750 at median 500 s over 3 seeds (400 s, 500 s, 900 s)",
                     "option: reaches 0.750 at median 400 s over 3 seeds (200 s, never, 400 s), 0.80x the first group's",
                     "worse: reaches 0.750 at median never over 3 seeds (never, never, 100 s)"]
    row, = real_model.rows([never], reach=0.75)
    assert row[-1] == "never" and real_model.rows(base, reach=0.75)[0][-1] == "400 s"


def test_rows_give_the_accuracy_at_each_mark_and_the_last():
    row, = real_model.rows([Run("ours", 3, CURVE, 1.5)])
    assert row == ["ours", 3, 0.5, 0.6, 0.7, 0.7, 0.65, "31 (910 s)", "+0.150", 1.5, "", "", ""]
    row, = real_model.rows([Run("ours", 3, CURVE, 1.5, (0.5, 0.02, 0.01))])
    assert row[-3:] == ["0.500", "0.020", "0.010"]


def test_runs_that_dropped_groups_get_a_column_the_others_leave_blank(tmp_path):
    ours, trl = _run_dirs(tmp_path)
    rows = [json.loads(line) for line in (ours / "metrics.jsonl").read_text().splitlines()]
    for row, dropped in zip(rows, (4, 9, 12)):
        row.update(prompts_dropped=float(dropped), groups_dropped_share=dropped / 40)
    (ours / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = [real_model.read_run(ours), real_model.read_run(trl)]
    assert runs[0].dropped == (12.0, 0.3)  # the last step's counters
    assert real_model.headers(runs)[-1] == "groups dropped (share)"
    assert [row[-1] for row in real_model.rows(runs)] == ["12 (0.30)", ""]
    assert real_model.headers(runs[1:]) == real_model.HEADERS  # no run dropped: no column
    assert len(real_model.rows(runs[1:])[0]) == len(real_model.HEADERS)


def test_runs_that_counted_their_tokens_get_tokens_a_second_and_evaluation_time(tmp_path):
    ours, trl = _run_dirs(tmp_path)
    rows = [json.loads(line) for line in (ours / "metrics.jsonl").read_text().splitlines()]
    for row, tokens in zip(rows, (300.0, 500.0, 400.0)):
        row.update(tokens_trained=tokens)
    rows[0]["eval/s"], rows[2]["eval/s"] = 20.0, 25.0  # step 0's evaluation, and step 3's
    (ours / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = [real_model.read_run(ours), real_model.read_run(trl)]
    assert runs[0].work == (1200.0 / 120.0, 45.0) and runs[1].work is None
    assert real_model.headers(runs, reach=0.6)[-3:] == ["tokens/s", "eval s", "reach 0.6"]
    assert [row[-3:-1] for row in real_model.rows(runs, reach=0.6)] == [["10.0", "45"], ["", ""]]
    assert real_model.headers(runs[1:]) == real_model.HEADERS  # no run counted: no columns


def test_idle_split_sets_step_1_and_the_steps_after_an_evaluation_apart():
    idle = {1: 0.9, 2: 0.1, 3: 0.0, 4: 0.3, 5: 0.5, 6: 0.2, 7: 0.4}
    first, after, other = real_model.idle_split(idle, {0, 3, 6})
    assert (first, after, other) == (0.9, (0.3 + 0.4) / 2, (0.1 + 0.0 + 0.5 + 0.2) / 4)


def _run_dirs(root: Path) -> tuple[Path, Path]:
    """An ours run directory (seed 1, an evaluation at step 2 that failed) and a TRL one, as each side writes them."""
    ours, trl = root / "seed_1", root / "trl_seed_1"
    ours.mkdir(parents=True)
    (ours / "config.yaml").write_text(yaml.safe_dump({"seed": 1, "trainer": {"train_batch_size": 32}}))
    (ours / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 40.0 * s,
                                                           "trainer_idle_ratio": 0.1 * s}) + "\n"
                                                for s in (1, 2, 3)))
    (ours / "eval.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a, "error": e}) + "\n" for s, a, e in
                                             ((0, 0.5, None), (2, 0.0, "maker lost"), (3, 0.6, None))))
    trl.mkdir()
    (trl / "trl.json").write_text(json.dumps({"seed": 1, "samples_per_s": 0.7}))
    (trl / "eval.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": t, "accuracy": a}) + "\n"
                                            for s, t, a in ((0, 0.0, 0.5), (10, 300.0, 0.55))))
    return ours, trl


def test_read_run_tells_the_sides_apart(tmp_path):
    ours, trl = _run_dirs(tmp_path)
    run = real_model.read_run(ours)
    assert (run.side, run.seed, run.points, run.samples_per_s) == ("ours", 1, [(0.0, 0, 0.5), (120.0, 3, 0.6)],
                                                                   3 * 32 / 120.0)
    assert run.idle == pytest.approx((0.1, 0.3, 0.2))  # evaluations at steps 0, 2 (which failed) and 3
    assert real_model.read_run(trl) == Run("trl", 1, [(0.0, 0, 0.5), (300.0, 10, 0.55)], 0.7)


def test_a_results_file_gives_back_its_runs_after_their_directories_are_gone(tmp_path, monkeypatch, capsys):
    import shutil

    results = tmp_path / "results"
    monkeypatch.setenv("RAY_PPO_BENCH_RESULTS", str(results))
    ours, trl = _run_dirs(tmp_path / "real_model_x")
    monkeypatch.setattr(sys, "argv", ["real_model.py", "--runs", str(ours), str(trl), "--tag", "x", "--reach", "0.55"])
    real_model.main()
    first = json.loads((results / "real_model_x.json").read_text())
    ours, trl = ours.resolve(), trl.resolve()
    assert [(r["dir"], r["side"], r["points"]) for r in first["runs"]] == \
        [(str(ours), "ours", [[0.0, 0, 0.5], [120.0, 3, 0.6]]), (str(trl), "trl", [[0.0, 0, 0.5], [300.0, 10, 0.55]])]
    expected = [(ours, real_model.read_run(ours)), (trl, real_model.read_run(trl))]
    shutil.rmtree(tmp_path / "real_model_x")
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["real_model.py", "--runs", str(results / "real_model_x.json"), "--tag", "y",
                                      "--reach", "0.55"])
    real_model.main()
    again = json.loads((results / "real_model_y.json").read_text())
    assert again["rows"] == first["rows"] and again["runs"] == first["runs"]
    assert "real_model_x (ours): reaches 0.550 at median 120 s over 1 seeds" in capsys.readouterr().out
    assert real_model.read_runs(results / "real_model_x.json") == expected


def test_a_results_file_without_its_runs_says_so(tmp_path):
    table_only = tmp_path / "real_model_old.json"
    table_only.write_text(json.dumps({"headers": real_model.HEADERS, "rows": []}))
    with pytest.raises(SystemExit, match="holds the table only"):
        real_model.read_runs(table_only)
    with pytest.raises(SystemExit, match="neither a run directory nor a results file"):
        real_model.read_runs(tmp_path / "missing")


def test_trl_settings_carry_the_grpo_config():
    from ray_ppo.config import load_config

    s = peer_trl_grpo.trl_settings(load_config(peer_trl_grpo.CONFIG))
    assert s["num_generations"] == 4 and s["per_device_train_batch_size"] == 16
    assert s["steps_per_generation"] == 2 and s["gradient_accumulation_steps"] == 1  # 2 updates on each 32
    assert s["max_steps"] == 200 * 2 and s["num_iterations"] == 1
    assert (s["max_completion_length"], s["temperature"], s["learning_rate"], s["lr_scheduler_type"]) == \
        (24, 1.0, 1e-5, "constant")
    assert (s["beta"], s["epsilon"], s["max_grad_norm"], s["weight_decay"]) == (0.0, 0.2, 1.0, 0.0)
    assert not s["gradient_checkpointing"] and not s["bf16"]
    assert "loss_type" not in s and "scale_rewards" not in s  # TRL's defaults, as shipped
    cpu = not torch.cuda.is_available()
    assert not s["use_cpu"]
    s = peer_trl_grpo.trl_settings(load_config(peer_trl_grpo.CONFIG, ["trainer.autocast=true"]))
    assert s["bf16"] and s["use_cpu"] == cpu  # TRL's bf16 autocast, as ours with trainer.autocast


def test_trl_settings_refuse_a_step_of_other_than_one_generation_batch():
    from ray_ppo.config import load_config

    cfg = load_config(peer_trl_grpo.CONFIG, ["trainer.train_batch_size=64"])  # ours: two batches of 8 prompts a step
    with pytest.raises(SystemExit, match="must be maker.batch_size x maker.samples_per_prompt"):
        peer_trl_grpo.trl_settings(cfg)


def test_arithmetic_reward_reads_trls_conversational_completions():
    from ray_ppo.tasks.arithmetic import reward

    trl_reward = peer_trl_grpo.arithmetic_reward(reward)
    prompt = [{"role": "user", "content": "What is 7 plus 5? Answer with a number."}]
    completions = [[{"role": "assistant", "content": "7 + 5 = 12"}], [{"role": "assistant", "content": "13"}]]
    assert trl_reward(prompts=[prompt, prompt], completions=completions, trainer_state=None) == [1.0, 0.0]
    assert trl_reward.__name__ == "reward"


def test_speed_reads_the_steady_steps(tmp_path):
    import real_model_speed

    rows = [{"step": s, "elapsed_s": 10.0 * s + (30.0 if s > 1 else 0.0), "train_s": 8.0 + s, "trainer_idle_ratio": 0.1,
             "maker_generate_s": 5.0, "maker_idle_ratio": 0.5, "tokens_computed": 100.0 * s, "tokens_trained": 40.0,
             "optimizer_s": 1.35} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, samples_per_s, train_s, trainer_idle, maker_s, maker_idle, computed, trained, optimizer = \
        real_model_speed.steady(tmp_path, 32)
    # steps 4-7 after step 3 ended at 60 s: 4 x 32 responses in 40 s
    assert (steps, samples_per_s, train_s) == (7, 4 * 32 / 40.0, (12 + 13 + 14 + 15) / 4)
    assert (trainer_idle, maker_s, maker_idle) == (0.1, 5.0, 0.5)
    assert (computed, trained, optimizer) == (550.0, 40.0, pytest.approx(1.35 / 13.5))


def test_report_prints_the_table_then_whole_summary_lines():
    ours = [Run("ours", 0, [(0.0, 0, 0.5), (400.0, 20, 0.7)], 2.0)]
    trl = [Run("trl", 0, [(0.0, 0, 0.5), (900.0, 60, 0.7)], 1.5)]
    lines = real_model.report(ours + trl).splitlines()
    assert lines[-3].startswith("ours: gain over 1 seeds: mean +0.200")
    assert lines[-2].startswith("trl: gain over 1 seeds")
    assert lines[-1].startswith("goal: ") and "met" in lines[-1]

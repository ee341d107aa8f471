"""Unit tests of the run outputs: TensorBoard scalars, the run directory, progress display, plots, trials CSV."""

from __future__ import annotations

import csv
import io
import math
import sys

import pytest
from matplotlib.image import imread

from ray_ppo.config import Config
from ray_ppo.outputs.plots import plot_run, plot_sweep, run_figure, write_trials_csv
from ray_ppo.outputs.tracking import TENSORBOARD_MISSING, LiveLine, Progress, RunDirectory, TensorBoardWriter, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_rows(n: int = 30) -> list[dict]:
    """A run whose reward rises from 0 towards 1 while kl grows and the losses shrink."""
    return [{"step": float(i), "policy_version": float(i), "reward_mean": 1 - math.exp(-i / 10),
             "reward_std": 0.2 * math.exp(-i / 20), "kl": 0.001 * i, "policy_loss": -0.05 / i,
             "value_loss": 0.5 * math.exp(-i / 8), "samples_per_s": 100.0 + i} for i in range(1, n + 1)]


def scalars(directory, tag: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a scalar tag in the event files of ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    events = acc.Scalars(tag)
    return [event.step for event in events], [event.value for event in events]


def assert_png(path, min_side: int = 100) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] > min_side and image.shape[1] > min_side
    assert image.min() < image.max(), "the image is blank"


# TensorBoard


def test_tensorboard_writer_scalars_read_back(tmp_path):
    writer = TensorBoardWriter(tmp_path / "tb")
    writer({"step": 1.0, "reward_mean": 0.25, "kl": 0.001})
    writer({"step": 2.0, "reward_mean": 0.5, "kl": 0.002})
    writer({"step": 3.0, "reward_mean": 0.75, "kl": 0.003})
    writer.close()

    steps, values = scalars(tmp_path / "tb", "reward_mean")
    assert steps == [1, 2, 3] and values == pytest.approx([0.25, 0.5, 0.75])
    steps, values = scalars(tmp_path / "tb", "kl")
    assert steps == [1, 2, 3] and values == pytest.approx([0.001, 0.002, 0.003])  # stored as float32


def test_tensorboard_writer_skips_non_finite_and_non_numeric(tmp_path):
    writer = TensorBoardWriter(tmp_path / "tb")
    writer({"step": 1, "reward_mean": 0.5, "kl": float("nan"), "value_loss": float("inf"), "note": "text",
            "approx_kl": None})
    writer({"step": 2, "reward_mean": 0.6, "kl": 0.01})
    writer.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["kl", "reward_mean"]
    steps, values = scalars(tmp_path / "tb", "kl")
    assert steps == [2] and values == pytest.approx([0.01])


def test_tensorboard_writer_without_tensorboard_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` of a None entry raises ImportError
    with pytest.raises(ImportError) as info:
        TensorBoardWriter(tmp_path / "tb")
    assert str(info.value) == TENSORBOARD_MISSING
    assert "pip install tensorboard" in str(info.value)
    assert "logging.tensorboard=false" in str(info.value)


# RunDirectory


def test_run_directory_with_tensorboard(tmp_path):
    rows = fake_rows(3)
    run_dir = RunDirectory(tmp_path / "run", Config(), tensorboard=True)
    for row in rows:
        run_dir(row)
    run_dir.close()

    assert (tmp_path / "run" / "config.yaml").is_file()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == rows
    assert any((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    steps, values = scalars(tmp_path / "run" / "tensorboard", "reward_mean")
    assert steps == [1, 2, 3] and values == pytest.approx([r["reward_mean"] for r in rows])


def test_run_directory_without_tensorboard_writes_no_events(tmp_path):
    run_dir = RunDirectory(tmp_path / "run", Config())
    run_dir({"step": 1, "reward_mean": float("nan")})
    run_dir.close()

    assert not (tmp_path / "run" / "tensorboard").exists()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "reward_mean": None}]


# Progress


def test_progress_plain_prints_the_live_line(tmp_path):
    rows = fake_rows(3)
    progress_out, live_out = io.StringIO(), io.StringIO()
    progress, live = Progress(3, stream=progress_out, bar=False), LiveLine(3, stream=live_out)
    for row in rows:
        progress(row)
        live(row)
    progress.close()

    lines = progress_out.getvalue().splitlines()
    assert len(lines) == 3
    assert progress_out.getvalue() == live_out.getvalue()
    assert lines[0] == "step 1/3 | reward 0.095 | kl 0.0010 | v 1 | samples/s 101.0"


def test_the_live_line_shows_a_streaming_runs_slots_lag_and_caches():
    row = {**fake_rows(1)[0], "maker_sequences_running": 12.0, "maker_slot_utilisation": 0.934,
           "token_lag_mean": 0.41, "token_lag_max": 2.0, "swaps_per_sequence": 0.25, "kv_kept": 40.0,
           "kv_recomputed": 0.0}
    out = io.StringIO()
    LiveLine(3, stream=out)(row)
    assert out.getvalue().rstrip().endswith(
        "| running 12, slots 0.93, lag 0.41, max 2, swaps/seq 0.25, kv kept 40, kv recomputed 0")
    batch_row = {**fake_rows(1)[0], "token_lag_mean": 0.5, "token_lag_max": 1.0}  # makers batch by batch
    out = io.StringIO()
    LiveLine(3, stream=out)(batch_row)
    assert "lag" not in out.getvalue()


def test_progress_defaults_to_plain_lines_when_not_a_terminal(capsys):
    progress = Progress(5)  # stdout is pytest's capture: not a TTY
    progress({"step": 2, "reward_mean": 0.25, "kl": 0.001, "policy_version": 2})
    progress.close()

    assert capsys.readouterr().out == "step 2/5 | reward 0.250 | kl 0.0010 | v 2\n"


def test_progress_bar_on_a_string_stream():
    stream = io.StringIO()
    progress = Progress(3, stream=stream, bar=True)
    for row in fake_rows(3):
        progress(row)
    progress.close()

    out = stream.getvalue()
    assert "3/3" in out
    assert "reward 0.259, kl 0.0030, samples/s 103.0" in out  # the postfix of the last row
    assert "step 1/3 |" not in out, "bar mode must not also print live lines"


def test_progress_bar_postfix_leaves_out_missing_and_non_finite_metrics():
    stream = io.StringIO()
    progress = Progress(4, stream=stream, bar=True)
    progress({"step": 2, "reward_mean": float("nan"), "samples_per_s": 5.0})
    progress.close()

    last = stream.getvalue().rsplit("\r", 1)[-1]
    assert "2/4" in last and "samples/s 5.0" in last
    assert "reward" not in last and "kl" not in last


def test_progress_bar_is_the_default_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(2, stream=stream)
    progress({"step": 1, "reward_mean": 0.5, "kl": 0.002, "samples_per_s": 9.0})
    progress.close()

    assert "1/2" in stream.getvalue() and "reward 0.500, kl 0.0020, samples/s 9.0" in stream.getvalue()


# plots


def test_plot_run_writes_a_png(tmp_path):
    path = plot_run(fake_rows(), tmp_path / "curves.png")

    assert path == tmp_path / "curves.png"
    assert_png(path)
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"], "the temporary file must be gone"


def test_plot_run_with_missing_keys_and_nulls(tmp_path):
    rows = [{"step": i, "reward_mean": i / 10, "kl": None if i == 2 else 0.01} for i in range(1, 6)]
    path = plot_run(rows, tmp_path / "sub" / "curves.png")

    assert_png(path)


def test_plot_run_draws_the_panels_whose_metric_the_rows_have_and_the_environments(tmp_path):
    """A GRPO run without a KL term has no kl, and without a critic no value_loss; a multi-turn run has env/..."""
    rows = [{"step": i, "reward_mean": i / 10, "reward_std": 0.1, "policy_loss": -0.01 * i, "env/fault": 0.19,
             "env/turns": 1.5, "env/tool_calls": 0.5, "fault_count": 12.0} for i in range(1, 6)]
    evals = [{"step": 0, "accuracy": 0.1, "num_prompts": 8, "error": None}]
    fig = run_figure(rows, evals)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["reward_mean", "policy_loss", "env/fault", "env/tool_calls",
                                                "env/turns", "eval/accuracy"]
    assert all(ax.lines for ax in shown) and not any(ax.texts for ax in shown)  # a curve in each, no "no 'kl'"
    assert [ax.get_title() for ax in run_figure(fake_rows()).axes if ax.get_visible()] == [
        "reward_mean", "kl", "policy_loss", "value_loss"]
    assert_png(plot_run(rows, tmp_path / "curves.png", evals))


def test_plot_run_overwrites_an_existing_file(tmp_path):
    path = tmp_path / "curves.png"
    path.write_bytes(b"old")
    plot_run(fake_rows(5), path)

    assert_png(path)


def test_plot_sweep_three_trials(tmp_path):
    trials = {f"lr={lr}": [{"step": s, "reward_mean": 1 - math.exp(-s * lr * 1e3)} for s in range(1, 21)]
              for lr in (1e-4, 3e-4, 1e-3)}
    path = plot_sweep(trials, tmp_path / "sweep.png")

    assert_png(path)


def test_plot_sweep_other_metric(tmp_path):
    trials = {"a": fake_rows(10), "b": fake_rows(5)}
    assert_png(plot_sweep(trials, tmp_path / "kl.png", metric="kl"))


# trials CSV


def test_write_trials_csv_round_trip(tmp_path):
    trials = [
        {"trial_id": "t0", "ppo.eps_clip": 0.1, "reward_mean": 0.8, "status": "TERMINATED", "checkpoint": "/c/0"},
        {"trial_id": "t1", "ppo.eps_clip": 0.2, "reward_mean": 0.7, "status": "ERROR", "checkpoint": None,
         "error": "OOM"},
        {"trial_id": "t2", "trainer.actor_lr": 1e-5, "status": "RUNNING"},
    ]
    path = write_trials_csv(trials, tmp_path / "trials.csv")

    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        back = list(reader)
    assert reader.fieldnames == ["trial_id", "ppo.eps_clip", "reward_mean", "status", "checkpoint", "error",
                                 "trainer.actor_lr"]
    assert back[0] == {"trial_id": "t0", "ppo.eps_clip": "0.1", "reward_mean": "0.8", "status": "TERMINATED",
                       "checkpoint": "/c/0", "error": "", "trainer.actor_lr": ""}
    assert back[1]["checkpoint"] == "" and back[1]["error"] == "OOM"
    assert back[2]["trainer.actor_lr"] == "1e-05" and back[2]["ppo.eps_clip"] == ""
    assert [p.name for p in tmp_path.iterdir()] == ["trials.csv"]

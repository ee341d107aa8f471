"""Unit tests of the ``ray-ppo`` command line (ray_ppo.cli.main), without a Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from ray_ppo.cli import EXIT_USAGE, main
from ray_ppo.config import load_config
from ray_ppo.outputs.tracking import LiveLine, read_metrics
from ray_ppo.tasks.toy import make_prompts

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")

# The tiny model is built before any command runs: its first build is not what these tests observe.
pytestmark = pytest.mark.usefixtures("tiny_path")


def one_error_line(capsys, command: str) -> str:
    """The single line the CLI printed to stderr, checked to start with ``ray-ppo <command>: error:``."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ray-ppo {command}: error: ")
    return lines[0]


@pytest.mark.parametrize("command", ["local", "train"])
def test_unknown_key_suggests_the_right_one(capsys, command):
    assert main([command, "--config", TINY, "trainer.totl_steps=2"]) == EXIT_USAGE
    line = one_error_line(capsys, command)
    assert "unknown key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?" in line


@pytest.mark.parametrize("override, message", [
    ("trainer.total_steps=many", "trainer.total_steps: expected an integer, got 'many'"),
    ("ppo.eps_clip=-0.1", "ppo.eps_clip=-0.1 is invalid: must be in (0, 1)"),
    ("trainer.mini_batch_size=48", "trainer.train_batch_size=64 is not a multiple of trainer.mini_batch_size=48; "
                                   "set trainer.train_batch_size=96 or trainer.mini_batch_size=32"),
])
def test_bad_value(capsys, override, message):
    assert main(["local", "--config", TINY, override]) == EXIT_USAGE
    assert message in one_error_line(capsys, "local")


def test_missing_config_file(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    assert main(["local", "--config", str(missing)]) == EXIT_USAGE
    assert f"config file not found: {str(missing)!r}" in one_error_line(capsys, "local")


def test_override_without_equals(capsys):
    assert main(["local", "--config", TINY, "trainer.total_steps"]) == EXIT_USAGE
    line = one_error_line(capsys, "local")
    assert "bad override 'trainer.total_steps': expected the form key=value" in line


def test_missing_data_path(capsys, tmp_path):
    missing = tmp_path / "prompts.csv"
    args = ["local", "--config", TINY, "--output", str(tmp_path / "run"), f"data.path={missing}"]
    assert main(args) == EXIT_USAGE
    assert f"data.path={str(missing)!r} does not exist" in one_error_line(capsys, "local")


def test_toy_data_writes_both_files(capsys, tmp_path):
    out = tmp_path / "toy"
    assert main(["toy-data", str(out), "--num-prompts", "10", "--prompt-len", "3", "--seed", "7"]) == 0
    csv_path, parquet_path = out / "toy_prompts.csv", out / "toy_prompts.parquet"
    assert capsys.readouterr().out.splitlines() == [str(csv_path), str(parquet_path)]
    expected = make_prompts(10, 3, seed=7)
    assert pd.read_csv(csv_path)["prompt"].tolist() == expected
    assert pd.read_parquet(parquet_path)["prompt"].tolist() == expected
    assert all(len(p.split()) == 3 for p in expected)


def test_local_run_writes_config_and_metrics(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/tiny.yaml names data/toy_prompts.csv relative to the repository
    out = tmp_path / "run"
    args = ["local", "--config", "configs/tiny.yaml", "--output", str(out), "trainer.total_steps=2",
            "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "maker.batch_size=8"]
    assert main(args) == 0

    saved = load_config(out / "config.yaml")
    assert saved.logging.output_dir == str(out)
    assert (saved.trainer.total_steps, saved.trainer.train_batch_size, saved.maker.batch_size) == (2, 8, 8)
    assert saved.data.path == "data/toy_prompts.csv"

    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["policy_version"] for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0
        assert isinstance(row["kl"], float)

    captured = capsys.readouterr()
    summary = captured.out.splitlines()[-1]
    assert summary.startswith("done: 2 steps in ")
    assert f"run dir {out}" in summary


def test_live_line_prints_to_the_current_stdout(capsys):
    LiveLine(total_steps=5)({"step": 2, "reward_mean": 0.25, "kl": 0.001, "policy_version": 2})
    assert capsys.readouterr().out == "step 2/5 | reward 0.250 | kl 0.0010 | v 2\n"


def test_live_line_format():
    import io

    stream = io.StringIO()
    LiveLine(total_steps=5, stream=stream)({"step": 2, "reward_mean": 0.25, "kl": 0.001, "policy_version": 2,
                                            "staleness_mean": 0.5, "samples_per_s": 12.34, "other": 1})
    assert stream.getvalue() == "step 2/5 | reward 0.250 | kl 0.0010 | v 2 | stale 0.50 | samples/s 12.3\n"


def test_tune_sweeps_the_estimator_and_off_policy_keys(capsys, monkeypatch, tmp_path):
    """`ray-ppo tune --grid algo.advantage=... --grid ppo.off_policy=...` validates every value and
    hands Tune a grid over both keys (the sweep itself is stubbed: tests/e2e runs real sweeps), on
    a local cluster with the dashboard."""
    import ray

    import ray_ppo.cli as cli
    import ray_ppo.cluster.sweep as sweep_module
    from ray_ppo.cluster.sweep import SweepOutcome

    seen = {}

    def fake_sweep(cfg, space, **kwargs):
        seen.update(space)
        return SweepOutcome({}, 0.0, None, "", [], None)

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    dashboards = []
    monkeypatch.setattr(cli, "_init_ray", lambda args, sweep=False: dashboards.append(sweep))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    config = str(ROOT / "configs" / "sum_mod10.yaml")
    assert main(["tune", "--config", config, "--output", str(tmp_path), "--grid", "algo.advantage=gae,grpo,rloo,reinforce_pp",
                 "--grid", "ppo.off_policy=none,tis,decoupled"]) == 0
    # A sweep's local cluster serves the state API, which Ray Train needs to free a stopped trial's CPUs.
    assert dashboards == [True]
    assert seen == {"algo.advantage": {"grid_search": ["gae", "grpo", "rloo", "reinforce_pp"]},
                    "ppo.off_policy": {"grid_search": ["none", "tis", "decoupled"]}}
    assert main(["tune", "--config", TINY, "--grid", "ppo.off_policy=none,clip"]) == EXIT_USAGE
    assert "ppo.off_policy='clip'" in one_error_line(capsys, "tune")


@pytest.mark.parametrize("options, message", [
    (["--async-search", "0"], "the async search needs a budget > 0 seconds per trial, got 0 (--async-search)"),
    (["--async-search", "30", "--confirm-repeats", "0"],
     "the confirmation needs at least 1 run per setting, got repeats=0 (--confirm-repeats)"),
    (["--async-search", "30", "--confirm-repeats", "3", "seed=4294967294"],
     "the confirmation runs at seeds 4294967294-4294967296"),
    (["--async-search", "30", "--first-rung", "1"],
     "ASHA's first stop must come inside the budget: a share in (0, 1), got 1 (--first-rung; default 0.5)"),
])
def test_async_search_refuses_a_bad_budget_or_confirmation_before_starting_a_cluster(capsys, monkeypatch, options,
                                                                                       message):
    import ray_ppo.cli as cli

    started = []
    monkeypatch.setattr(cli, "_init_ray", lambda args, sweep=False: started.append(sweep))
    assert main(["tune", "--config", TINY, *options]) == EXIT_USAGE
    assert message in one_error_line(capsys, "tune")
    assert not started


def test_version_is_the_projects_and_has_a_changelog_entry(capsys):
    """``ray-ppo --version`` prints the installed distribution's version, which is pyproject.toml's
    (a stale install fails here: ``make install`` reinstalls when pyproject.toml changes), and
    CHANGELOG.md says what that version holds."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"ray-ppo {version}\n"
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("command", ["train", "local"])
def test_a_run_without_any_config_is_refused(command, capsys, monkeypatch, tmp_path):
    """`ray-ppo train` alone started a 50-step run of the defaults in ./runs/ray_ppo."""
    monkeypatch.chdir(tmp_path)
    assert main([command]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ray-ppo {command}: error: ray-ppo {command} needs a config: give --config FILE (configs/tiny.yaml is the "
        f"CPU demo) or key=value settings; ray-ppo config lists every key")
    assert not (tmp_path / "runs").exists()

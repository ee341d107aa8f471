"""W&B and MLflow sinks, with stand-in modules (neither package is a dependency)."""

import sys
import types

import pytest

from ray_ppo.config import Config, ConfigError
from ray_ppo.tracking import RunDirectory

ROW = {"step": 3, "reward_mean": 0.5, "kl": 0.01, "weights_in_sync": float("nan"), "note": "text"}


def fake_wandb(calls):
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", data, step)),
                                finish=lambda: calls.append(("finish",)))
    return types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)


def fake_mlflow(calls):
    return types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda params: calls.append(("params", params)),
        log_metrics=lambda metrics, step: calls.append(("metrics", metrics, step)),
        end_run=lambda: calls.append(("end",)))


def test_wandb_gets_every_numeric_metric_with_its_step(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    cfg = Config().with_overrides({"logging.wandb": True, "logging.tensorboard": False, "logging.project": "p"})
    run = RunDirectory(tmp_path, cfg)
    run(ROW)
    run.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "p" and calls[0][1]["config"]["ppo"]["kl_coef"] == 0.05
    assert calls[1] == ("log", {"reward_mean": 0.5, "kl": 0.01}, 3)  # NaN and text left out
    assert calls[-1] == ("finish",)


def test_mlflow_gets_params_and_metrics(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls))
    cfg = Config().with_overrides({"logging.mlflow": True, "logging.tensorboard": False})
    run = RunDirectory(tmp_path, cfg)
    run(ROW)
    run.close()
    assert calls[0] == ("experiment", "ray_ppo") and calls[1] == ("start", "ray_ppo")
    assert calls[2][0] == "params" and calls[2][1]["ppo.eps_clip"] == "0.2"
    assert calls[3] == ("metrics", {"reward_mean": 0.5, "kl": 0.01}, 3) and calls[-1] == ("end",)


def test_missing_package_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = Config().with_overrides({"logging.wandb": True, "logging.tensorboard": False})
    with pytest.raises(ConfigError, match=r"^logging.wandb=true needs the wandb package: pip install wandb, or set logging.wandb=false$"):
        RunDirectory(tmp_path, cfg)

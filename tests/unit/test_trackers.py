"""W&B and MLflow sinks against the real packages: wandb in offline mode, MLflow with a local file store.

Both are in the ``test`` extra (``pip install -e .[test]``); without them these tests are skipped.
"""

import json
import sys
import time
from pathlib import Path

import pytest

from ray_ppo.config import Config, ConfigError
from ray_ppo.outputs.tracking import RunDirectory

ROW = {"step": 3, "reward_mean": 0.5, "kl": 0.01, "weights_in_sync": float("nan"), "note": "text"}


BLOCK, CHUNK_HEADER = 32768, 7


def wandb_records(path: Path):
    """The protobuf Records of a W&B offline run file: a LevelDB-style log of 32 KiB blocks holding
    [crc32 4 | length 2 | type 1 | data] chunks, after a 7-byte ':W&B' file header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = CHUNK_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The run file's records once its exit record is there: wandb-core (a process of its own)
    may still be writing the file when ``finish()`` returns (seen here: a 7-byte header-only file
    right after ``finish()``, 3 times in 6)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(path))
        except Exception:  # noqa: BLE001 - a record still being written does not parse yet
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_wandb_gets_every_numeric_metric_with_its_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the test extra: pip install -e .[test]")
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine; the run is written under dir
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")  # a busy CI machine starts wandb's service slowly
    cfg = Config().with_overrides({"logging.wandb": True, "logging.tensorboard": False, "logging.project": "p",
                                   "name": "run-a"})
    run = RunDirectory(tmp_path, cfg)
    run(ROW)
    run({**ROW, "step": 4, "reward_mean": 0.75})
    run.close()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = finished_records(run_file)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (started.project, started.display_name) == ("p", "run-a")
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["ppo"]["kl_coef"] == 0.05 and config["name"] == "run-a"
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row.get("_step")} for row in rows] == [
        {"reward_mean": 0.5, "kl": 0.01, "step": 3}, {"reward_mean": 0.75, "kl": 0.01, "step": 4}]  # NaN, text left out
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished


def test_mlflow_gets_params_and_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is in the test extra: pip install -e .[test]")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local file store,
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # which MLflow 3 keeps (in maintenance mode) behind this flag
    cfg = Config().with_overrides({"logging.mlflow": True, "logging.tensorboard": False, "name": "run-b"})
    run = RunDirectory(tmp_path / "run", cfg)
    run(ROW)
    run({**ROW, "step": 4, "reward_mean": 0.75})
    run.close()

    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("ray_ppo")
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.run_name == "run-b" and logged.info.status == "FINISHED"
    assert logged.data.params["ppo.eps_clip"] == "0.2" and logged.data.params["model.pretrained"] == "tiny"
    history = client.get_metric_history(logged.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(3, 0.5), (4, 0.75)]
    assert set(logged.data.metrics) == {"reward_mean", "kl"}  # NaN and text left out


def test_missing_package_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = Config().with_overrides({"logging.wandb": True, "logging.tensorboard": False})
    message = r"^logging.wandb=true needs the wandb package: pip install wandb, or set logging.wandb=false$"
    with pytest.raises(ConfigError, match=message):
        RunDirectory(tmp_path, cfg)

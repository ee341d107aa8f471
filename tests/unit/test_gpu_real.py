"""scripts/gpu_real.py and configs/smollm2_grpo_gpu.yaml: the config validates, a vLLM maker and a
trainer worker fit one GPU, the CPU dry run's overrides are valid, and the report reads a run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ray_ppo.config import ConfigError, load_config
from ray_ppo.config.resources import ResourcePlan, check_fits

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_real  # noqa: E402


def test_the_gpu_config_shares_one_gpu_between_the_maker_and_the_trainer():
    cfg = load_config(gpu_real.CONFIG, ["maker.engine=hf"])  # vllm is not installed in every environment
    assert (cfg.maker.num_gpus, cfg.trainer.use_gpu, cfg.trainer.gpus_per_worker) == (0.5, True, 0.5)
    assert cfg.trainer.strategy == "fsdp" and cfg.eval.path
    check_fits(ResourcePlan.of(cfg), {"CPU": 16.0, "GPU": 1.0})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_the_gpu_config_names_vllm_where_it_is_missing():
    with pytest.raises(ConfigError, match="maker.engine='vllm' needs the vllm package"):
        load_config(gpu_real.CONFIG)


def test_the_cpu_dry_run_overrides_make_a_cpu_run():
    cfg = load_config(gpu_real.CONFIG, gpu_real.CPU_DRY_RUN)
    assert ResourcePlan.of(cfg).gpus == 0 and cfg.maker.engine == "hf" and cfg.maker.vllm.dtype is None


def test_report_reads_the_evaluations_at_their_steps_training_seconds(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 2.5 * s}) + "\n"
                                                    for s in range(1, 13)))
    rows = [(0, 0, 0.5, None), (10, 10, 0.0, "maker lost"), (12, 12, 0.75, None)]
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps({"step": s, "policy_version": v, "accuracy": a, "error": e, "num_prompts": 48}) + "\n"
        for s, v, a, e in rows))
    evals = gpu_real.evaluations(tmp_path)
    assert [(r["step"], r["elapsed_s"], r["accuracy"]) for r in evals] == [(0, 0.0, 0.5), (12, 30.0, 0.75)]
    text = gpu_real.report(evals, 200.0)
    assert "| 12 | 12 | 30 | 0.750 |" in text
    assert "0.500 (step 0) -> 0.750 (step 12): +0.250 on 48 questions; 200 s" in text

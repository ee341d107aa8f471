"""What a run reserves against what the cluster has (``ray_ppo.config.resources``): no cluster."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ray_ppo import cli
from ray_ppo.config import load_config
from ray_ppo.config.resources import ResourceError, ResourcePlan, check_fits, cluster_can_grow, worker_resources

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
pytestmark = pytest.mark.usefixtures("tiny_path")


def test_tiny_reserves_its_makers_trainer_and_prompt_reader():
    plan = ResourcePlan.of(load_config(TINY))
    assert plan.cpus == pytest.approx(2 * 0.5 + 1 * 1 + 0.25) and plan.gpus == 0
    assert plan.line({"CPU": 8.0}) == ("resources: 2 makers x 0.5 CPU + 1 trainer worker x 1 CPU + prompt reader "
                                       "0.25 CPU = 2.25 CPUs of the cluster's 8")


def test_a_dataset_given_to_the_trainer_is_read_at_ray_datas_default_of_one_cpu():
    assert ResourcePlan.of(load_config(TINY), given_dataset=True).cpus == pytest.approx(3.0)


def test_trials_side_by_side_multiply_the_plan():
    plan = ResourcePlan.of(load_config(TINY), trials=3, trial_cpus=0.01)
    assert plan.cpus == pytest.approx(3 * 2.26)
    assert plan.parts().startswith("3 trials x (2 makers x 0.5 CPU + ")


def test_a_two_cpu_cluster_is_refused_with_both_numbers_and_the_fix():
    """tiny.yaml on a plain ``ray.init()`` of a 2-core machine: the prompt reader found no CPU, and
    the run hung for 120 s before a misleading pull time-out."""
    with pytest.raises(ResourceError) as e:
        check_fits(ResourcePlan.of(load_config(TINY)), {"CPU": 2.0})
    message = str(e.value)
    assert message.startswith("the run reserves 2.25 CPUs (2 makers x 0.5 CPU + 1 trainer worker x 1 CPU + "
                              "prompt reader 0.25 CPU) but the cluster has 2")
    assert "maker.num_makers" in message and "maker.num_cpus" in message and "ray.init(num_cpus=8)" in message
    assert "\n" not in message


def test_what_fits_passes_and_a_cluster_that_can_grow_is_never_refused():
    plan = ResourcePlan.of(load_config(TINY))
    check_fits(plan, {"CPU": 2.25})
    check_fits(plan, {"CPU": 1.0}, can_grow=True)


def test_gpus_are_checked_too():
    plan = ResourcePlan.of(load_config(TINY, ["maker.num_gpus=1"]))
    assert plan.gpus == 2
    with pytest.raises(ResourceError, match="the run reserves 2 GPUs .* but the cluster has 1;"):
        check_fits(plan, {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(ResourceError, match="but the cluster has 0;"):
        check_fits(plan, {"CPU": 8.0})  # Ray lists no GPU key on a cluster without GPUs


def test_makers_and_a_trainer_worker_may_share_one_gpu():
    cfg = load_config(TINY, ["maker.num_makers=1", "maker.num_gpus=0.5", "trainer.use_gpu=true",
                             "trainer.gpus_per_worker=0.5"])
    plan = ResourcePlan.of(cfg)
    assert plan.gpus == 1.0
    check_fits(plan, {"CPU": 8.0, "GPU": 1.0})
    assert worker_resources(cfg.trainer) == {"CPU": cfg.trainer.cpus_per_worker, "GPU": 0.5}
    whole = load_config(TINY, ["maker.num_makers=1", "maker.num_gpus=0.5", "trainer.use_gpu=true"])
    with pytest.raises(ResourceError, match="reserves 1.5 GPUs .* trainer.gpus_per_worker"):
        check_fits(ResourcePlan.of(whole), {"CPU": 8.0, "GPU": 1.0})
    assert "GPU" not in worker_resources(load_config(TINY).trainer)


def test_a_process_without_a_cluster_of_its_own_may_see_the_cluster_grow():
    """``cluster_can_grow`` reads the driver's node (``ray_ppo.cluster.ray_private``; tests/unit/test_ray_private.py
    fails on a Ray release that moves it)."""
    assert cluster_can_grow()


def test_the_cli_refuses_a_local_cluster_too_small_before_it_starts(monkeypatch, tmp_path, capsys):
    """``ray-ppo train --num-cpus 2`` waited 120 s and printed ~130 lines; now: one line, status 2,
    no cluster started."""
    monkeypatch.setattr(cli, "_init_ray", lambda *a, **k: pytest.fail("a cluster was started"))
    code = cli.main(["train", "--config", str(TINY), "--num-cpus", "2", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("ray-ppo train: error: the run reserves 2.25 CPUs")
    assert "but the local cluster (--num-cpus) has 2, so part of it would wait forever" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was claimed


def test_math_inf_gpus_skip_the_gpu_check_before_a_local_cluster_detects_its_gpus():
    check_fits(ResourcePlan.of(load_config(TINY, ["maker.num_gpus=1"])), {"CPU": 8.0, "GPU": math.inf})

"""Shared helpers of the benchmarks: medians, markdown tables, a quiet local Ray."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if v != v:
                return "n/a"
            a = abs(v)
            return f"{v:.3g}" if a < 100 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


ONE_MAKER_ONE_WORKER = {
    "maker.num_makers": 1, "maker.num_cpus": 1, "maker.torch_threads": 1,
    "trainer.num_workers": 1, "trainer.cpus_per_worker": 1, "trainer.torch_threads": 1,
    "logging.progress": False, "logging.tensorboard": False, "logging.report_every": 1000,
    "data.path": str(ROOT / "data" / "toy_prompts.csv"),
}
"""The detached run of the timing benchmarks: one maker and one trainer worker, one torch
thread each, on the toy prompts, no progress bar, TensorBoard or per-step Ray Train reports."""


def tiny_config(out: str, overrides: dict):
    """``configs/tiny.yaml`` with ``ONE_MAKER_ONE_WORKER``, run directory ``out``, then ``overrides``."""
    from ray_ppo.config import load_config

    return load_config(str(ROOT / "configs" / "tiny.yaml")).with_overrides(
        {**ONE_MAKER_ONE_WORKER, "logging.output_dir": out, **overrides})


def init_ray(num_cpus: int = 8, object_store_gb: float | None = None):
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # as the CLI's local cluster (ray_ppo/cli.py)
    os.environ.setdefault("RAY_worker_maximum_startup_concurrency", str(num_cpus))  # no worker-count warning, as the CLI
    kwargs = {"num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": False}
    if object_store_gb:
        kwargs["object_store_memory"] = int(object_store_gb * 2**30)
    # Workers import ray_ppo from this checkout: they inherit PYTHONPATH from the raylet that this
    # ray.init starts. Not a job runtime_env, which would make every worker process start through
    # Ray's runtime-env setup (2-3 s of CPU each on 2 cores: benchmarks/README, Start-up).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", **kwargs)
    return ray


def rss_mb(pid: int | None = None) -> float:
    """Current resident set size in MiB (Linux /proc)."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")

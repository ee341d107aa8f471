"""Shared helpers of the benchmarks: medians, markdown tables, results as data, a quiet local Ray.

Every script ends with ``publish(name, headers, rows, args)``: it prints the table and writes
``benchmarks/results/NAME.json`` (the command, its arguments, the machine, the commit, the date,
the rows); ``benchmarks/render.py`` builds README's tables from those files. With
``RAY_PPO_BENCH_QUICK=1`` (``make bench-quick``) each script runs a small version of itself and its
results go to ``benchmarks/results/quick/``, which README never shows.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


RESULTS = ROOT / "benchmarks" / "results"
QUICK_ENV = "RAY_PPO_BENCH_QUICK"
RESULTS_ENV = "RAY_PPO_BENCH_RESULTS"


def quick() -> bool:
    """Whether this is a quick run (``RAY_PPO_BENCH_QUICK=1``): a smoke check of the script, not a figure."""
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def results_dir() -> Path:
    """Where results go: ``RAY_PPO_BENCH_RESULTS`` if set, else ``benchmarks/results`` (``/quick`` in quick mode)."""
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    return RESULTS / "quick" if quick() else RESULTS


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags a figure depends on: two CPUs of one model name may differ in them (an AMD EPYC with
avx512_bf16 trains in bfloat16 faster than in float32; one without emulates bfloat16, several times slower)."""


def machine() -> dict:
    """The machine a figure was measured on."""
    cpuinfo = _read("/proc/cpuinfo").splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    mem_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), 0)
    versions = {}
    for package in ("torch", "ray", "transformers"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # not installed in this environment
            pass
    return {"cpu": cpu, "cpu_features": [f for f in CPU_FEATURES if f in flags], "cores": os.cpu_count(),
            "memory_gib": round(mem_kb / 2**20, 1),
            "load_average_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(), **versions}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def commit() -> str:
    """The checkout's commit (with ``+changes`` when its tracked files differ from it)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        # Not benchmarks/results: a script that publishes its table as it goes has changed its own file by then.
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ray_ppo", "benchmarks", ":!benchmarks/results"],
                               cwd=ROOT).returncode
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def publish(name: str, headers: list[str], rows: list[list], args: object = None, title: str = "",
            extra: dict | None = None) -> Path:
    """Print the table (after ``title``, if given) and write it with its provenance to
    ``results_dir()/NAME.json``, atomically; returns the file. ``extra``: more keys for the file
    (what the table was computed from, where a script can read it back: ``real_model.py``'s curves)."""
    if title:
        print(f"\n{title}\n", flush=True)
    print(table(headers, rows), flush=True)
    record = {
        "benchmark": name, "title": title,
        "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "args": dict(vars(args)) if args is not None else {},
        "quick": quick(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(), "machine": machine(), "headers": headers, "rows": rows, **(extra or {}),
    }
    out = results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    tmp.replace(out)
    return out


def _plain(value):
    """JSON for the numpy and torch scalars a row may hold."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return median(times)


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
    from ray_ppo.cluster.local_cluster import WORKER_NICENESS_ENV

    os.environ.setdefault(WORKER_NICENESS_ENV, "0")  # workers at the users' programs' priority, as the CLI's cluster
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

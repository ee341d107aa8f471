"""Where a detached run's CPU time goes, in two windows of one steady-state run.

    python benchmarks/profile_detached.py [--setting balanced] [--seconds 20] [--rate 20] [--set KEY=VALUE ...]

Runs ``PPOTrainer.fit`` (an ``overlap.py`` setting, 1 maker + 1 trainer worker, one torch thread
each; ``--set`` adds config overrides) and waits until ``--warmup-steps`` steps are trained
(start-up excluded). Then:

1. **Nothing attached**: /proc CPU time of every process of the local cluster (the raylet, GCS,
   agents, idle workers and every actor, found as descendants of this driver) and of the machine
   for ``--seconds``, with the steps trained meanwhile. This is the true split: a profiler's own
   CPU would distort it on 2 cores.
2. **py-spy** (``record --format raw --nonblocking``) on the maker, the trainer rank and the
   coordinator for ``--seconds``. py-spy counts a thread when it is not waiting in a known
   blocking call, so it counts running and runnable time, not CPU time; its table gives each
   process's split. Each sample goes to the category of the innermost frame that matches one
   (a Ray call made inside the learner counts as Ray). What is neither generation nor training
   is the per-step overhead issue 15 asks to remove; the last two tables name its heaviest leaf
   functions and the ray_ppo calls that caused them.

py-spy is a benchmark-only tool (``pip install py-spy``), not a project dependency. Its idle
detection misses Ray's task loop (``Worker.main_loop``, in C++ behind a Python frame): an idle
actor shows samples there that /proc does not confirm, so read window 1 for CPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from overlap import SETTINGS

from _common import init_ray, publish, tiny_config

CATEGORIES = [  # (name, markers: any one in a frame's "function (file)" text); checked leaf first
    ("generation", ["generate (transformers", "_sample (transformers", "makers/experience.py", "makers/worker.py"]),
    ("training", ["train/learner.py", "ray_ppo/algo/", "torch/optim/", "torch/autograd/"]),
    ("weight push / load", ["models/sync.py", "train/publish.py", "fingerprint"]),
    ("experience transport", ["wire/packed.py", "wire/transport.py", "ray_ppo/coordinator/"]),
    ("pickle / object store", ["serialization.py", "pickle", "object_ref"]),
    ("metrics / report", ["train/monitor.py", "algo/metrics.py", "ray/train/", "ray_ppo/outputs/",
                          "ray_ppo/api.py"]),
    ("ray core (rpc, event loop)", ["ray/_private/", "ray/actor.py", "ray/_raylet", "asyncio", "grpc"]),
]
OTHER = "other"


def classify(frames: list[str]) -> str:
    """The category of one stack (frames root first): the innermost frame that matches one."""
    for frame in reversed(frames):
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return OTHER


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: ``frame;frame;... count`` per line, root first."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def pipeline_processes() -> dict[str, int]:
    """The pids of the run's coordinator, maker and trainer worker (from the GCS actor table)."""
    import ray._private.state

    roles = {}
    for a in ray._private.state.actors().values():
        if a["State"] != "ALIVE" or not a.get("Pid"):
            continue
        if a["ActorClassName"] == "RayTrainWorker":
            roles[f"trainer worker {a['Pid']}"] = a["Pid"]
        elif a["Name"] in ("coordinator", "maker_0"):
            roles[a["Name"]] = a["Pid"]
    return roles


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (so ppid is [1], utime [11], stime [12])."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid`` so far (/proc), C++ threads included."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> dict[str, float]:
    """This machine's CPU seconds so far by state, all cores (/proc/stat's first line)."""
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
    values = Path("/proc/stat").read_text().splitlines()[0].split()[1:1 + len(names)]
    return {n: int(v) / os.sysconf("SC_CLK_TCK") for n, v in zip(names, values)}


def cluster_processes(root: int) -> dict[int, str]:
    """Every descendant of ``root`` (the local cluster this driver started: GCS, raylet, agents,
    workers), by pid, named by its command line's first words."""
    children = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(_stat_fields(d.name)[1])
            except (OSError, IndexError):
                continue
            children[ppid].append(int(d.name))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmd = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
            except OSError:
                continue
            if "py-spy" not in cmd:
                out[child] = _process_name(cmd)
                todo.append(child)
    return out


def _process_name(cmd: str) -> str:
    words = cmd.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]  # a worker names its actor (and the method it runs) or ray::IDLE
    if "python" not in Path(words[0]).name:
        return Path(words[0]).name  # a binary: raylet, gcs_server (their arguments name scripts too)
    return Path(next((w for w in words[1:] if w.endswith(".py")), words[0])).name


def profile(pids: dict[str, int], seconds: float, rate: int, out: Path, py_spy: str) -> dict[str, Path]:
    """One ``py-spy record`` per process, all at once; returns the raw files by role."""
    procs, files = [], {}
    for role, pid in pids.items():
        files[role] = out / f"{role.replace(' ', '_')}.txt"
        procs.append(subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
             "--format", "raw", "--nonblocking", "--output", str(files[role])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=seconds + 60)
        if p.returncode:
            print(f"py-spy failed ({p.returncode}): {err.strip()[-300:]}", file=sys.stderr)
    return {role: f for role, f in files.items() if f.exists()}


def proc_window(seconds: float, history: list[dict]) -> dict:
    """``seconds`` of the run with nothing attached: /proc CPU time of every process of the local
    cluster and of the machine, and the steps trained meanwhile."""
    everything = {**cluster_processes(os.getpid()), os.getpid(): "driver"}
    before, machine_before, steps_before = {pid: cpu_seconds(pid) for pid in everything}, machine_cpu(), len(history)
    time.sleep(seconds)
    used = {pid: cpu_seconds(pid) - before[pid] for pid in everything}
    by_name = collections.Counter()
    for pid, name in everything.items():
        if used[pid] == used[pid]:  # not nan (the process ended in the window)
            by_name[name] += used[pid]
    machine = {k: v - machine_before[k] for k, v in machine_cpu().items()}
    return {"by_name": by_name, "machine": machine, "window": history[steps_before:]}


def print_proc_window(w: dict, seconds: float) -> None:
    window, by_name, machine = w["window"], w["by_name"], w["machine"]
    keys = ["trainer_idle_ratio", "maker_idle_ratio", "train_s", "maker_generate_s", "staleness_mean"]
    print(f"\nWindow 1 ({seconds:.0f} s, nothing attached): {len(window)} steps trained ({len(window) / seconds:.2f} "
          "steps/s); medians over its steps: " + ", ".join(
              f"{k} {statistics.median(m[k] for m in window if k in m):.3g}" for k in keys if any(k in m for m in window)))
    busy = sum(v for k, v in machine.items() if k not in ("idle", "iowait"))
    cluster = sum(by_name.values())
    pipeline = by_name["ray::MakerWorker"] + by_name["ray::RayTrainWorker"]
    print(f"machine (/proc/stat): busy {busy:.2f} CPU s of {os.cpu_count() * seconds:.0f}, idle {machine['idle']:.2f}, "
          f"steal {machine['steal']:.2f}; the local cluster {cluster:.2f}, of which maker + trainer {pipeline:.2f} "
          f"({pipeline / max(cluster, 1e-9):.0%}); the rest {cluster - pipeline:.2f} CPU s = "
          f"{(cluster - pipeline) / max(len(window), 1) * 1000:.0f} ms per step\n")
    publish("profile_detached_processes", ["process of the local cluster (command)", "CPU s", "share of the cluster's"],
                [[k, v, v / max(cluster, 1e-9)] for k, v in by_name.most_common()])


def print_spy_window(stacks: dict, steps: int, args) -> None:
    names = [name for name, _ in CATEGORIES] + [OTHER]
    rows, leaves, callers = [], collections.Counter(), collections.Counter()
    for role, samples in stacks.items():
        by = collections.Counter()
        for frames, n in samples:
            cat = classify(frames)
            by[cat] += n
            if cat not in ("generation", "training"):
                leaves[f"{role}: {frames[-1]}"] += n
                ours = [f for f in frames if "ray_ppo/" in f]
                callers[f"{role}: {ours[-1] if ours else '(no ray_ppo frame)'}"] += n
        total = sum(by.values())
        rows.append([role, total / args.rate] + [by[c] / max(total, 1) for c in names])
    rows.sort(key=lambda r: -r[1])
    print(f"\nWindow 2 ({args.seconds:.0f} s, py-spy at {args.rate} Hz on {', '.join(stacks)}; py-spy's own CPU "
          f"slows the run): {steps} steps. Seconds not waiting (running or runnable), and their split:\n")
    publish("profile_detached_busy", ["process", "s not waiting"] + names, rows, args=args)
    print("\nheaviest leaf frames outside generation and training (s):\n")
    publish("profile_detached_leaves", ["process: function (file:line)", "s"],
            [[k, v / args.rate] for k, v in leaves.most_common(args.top)], args=args)
    print("\nthe same samples by their innermost ray_ppo frame (which of our calls caused them):\n")
    publish("profile_detached_callers", ["process: function (file:line)", "s"],
            [[k, v / args.rate] for k, v in callers.most_common(args.top)], args=args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", default="balanced", choices=sorted(SETTINGS))
    p.add_argument("--seconds", type=float, default=20.0, help="length of each of the two windows")
    p.add_argument("--rate", type=int, default=20,
                   help="py-spy samples per second per process (at 50 the short-step run slowed 4x)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override on top of the setting (repeatable), e.g. ppo.max_staleness=2")
    p.add_argument("--keep", default=None, help="folder to keep py-spy's raw files in")
    args = p.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        sys.exit("py-spy is not installed: pip install py-spy")

    ray = init_ray()
    from ray_ppo.api import PPOTrainer

    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory() as raw_dir:
        overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
        cfg = tiny_config(run_dir, {**SETTINGS[args.setting], "trainer.torch_threads": 1, "trainer.total_steps": 100000,
                                    "trainer.time_budget_s": 600, **overrides})
        trainer = PPOTrainer(cfg)
        fit = threading.Thread(target=trainer.fit, daemon=True)
        fit.start()
        while len(trainer.history) < args.warmup_steps:
            if not fit.is_alive():
                sys.exit("the run ended before its warm-up steps")
            time.sleep(0.2)
        first = proc_window(args.seconds, trainer.history)
        pids = pipeline_processes()
        steps_before = len(trainer.history)
        files = profile(pids, args.seconds, args.rate, Path(raw_dir), py_spy)
        steps = len(trainer.history) - steps_before
        if args.keep:
            shutil.copytree(raw_dir, args.keep, dirs_exist_ok=True)
        stacks = {role: parse_raw(f) for role, f in files.items()}
        ray.shutdown()  # ends the run (its actors die with the local cluster)

    print(f"\n{args.setting} setting ({', '.join(f'{k}={v}' for k, v in {**SETTINGS[args.setting], **overrides}.items())}), "
          f"1 maker + 1 trainer worker, one torch thread each, after {args.warmup_steps} steps")
    print_proc_window(first, args.seconds)
    print_spy_window(stacks, steps, args)


if __name__ == "__main__":
    main()

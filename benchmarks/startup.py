"""Start-up: ``PPOTrainer.fit()`` from the call to the end of the first trained step, in phases.

    python benchmarks/startup.py [--repeats 3] [--config configs/tiny.yaml]

Runs ``fit()`` on ``configs/tiny.yaml`` (its makers and trainer worker, 2 steps) in a Ray
cluster that is already up (``ray.init`` is not counted: a script or a Tune trial pays it once).
Timestamps come from the real run, through ``PPOTrainer``'s extension points only: the
experience-maker factory (the real ``build_experience_maker``) notes when each maker process
starts building its models, when they are built and when its first batch is made; the learner
factory (the real ``PPOLearner``) notes when a trainer rank has built its models and when its
first ``train_step`` ends. Phases, in seconds from the ``fit()`` call (medians over rounds):

- ``makers built``: the last maker's models are built (process start + imports + models);
- ``first batch made``: the first generation batch of any maker is done;
- ``rank 0 ready``: the Ray Train worker group is up and rank 0 built actor, critic, learner;
- ``first step trained``: rank 0's first ``train_step`` returned (the goal: <= 8 s).

Where the CPU went: a thread samples every process's CPU time (``psutil``, every 0.2 s) from the
``fit()`` call to its return and sums it by role (Ray's process title: ``ray::MakerWorker``,
``ray::TrainController``, ...), next to the machine's busy CPU-seconds over the same window
(``/proc/stat``) and the most it could have given (cores x wall). A process that exits between two
samples loses at most its last 0.2 s.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time

import psutil

import _common  # noqa: F401
from _common import ROOT, init_ray, median, publish
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.train.learner import PPOLearner


def note(directory: str, event: str) -> None:
    """Append ``event wall-clock-time`` to a file of its own (one writer per file, no locking)."""
    with open(os.path.join(directory, f"{event}.{os.getpid()}"), "a") as f:
        f.write(f"{time.time()}\n")


class TimedMakerFactory:
    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, cfg, name: str, device):
        note(self.directory, "maker_build_start")
        maker = build_experience_maker(cfg, name=name, device=device)
        note(self.directory, "maker_built")
        directory, make = self.directory, maker.make_experience

        def timed(*args, **kwargs):
            out = make(*args, **kwargs)
            note(directory, "maker_batch")
            return out
        maker.make_experience = timed
        return maker


class TimedLearner(PPOLearner):
    directory = ""

    def train_step(self, batch, **kwargs):
        out = super().train_step(batch, **kwargs)
        note(self.directory, "train_step")
        return out


class TimedLearnerFactory:
    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, actor, critic, strategy, cfg, seed: int = 0):
        note(self.directory, "rank_ready")
        learner = TimedLearner(actor, critic, strategy, cfg, seed=seed)
        learner.directory = self.directory
        return learner


def events(directory: str) -> dict[str, list[float]]:
    out = collections.defaultdict(list)
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as f:
            out[name.split(".")[0]] += [float(line) for line in f]
    return out


ROLES = [  # (role, substrings of the process title), first match wins
    ("makers", ["ray::MakerWorker"]),
    ("coordinator", ["ray::Coordinator"]),
    ("Ray Train controller", ["ray::TrainController"]),
    ("Ray Train worker (rank 0)", ["ray::RayTrainWorker"]),
    ("Ray Train helper actors", ["ray::SynchronizationActor", "ray::PlacementGroupCleaner", "ray::DatasetManager"]),
    ("Ray Data (read tasks, stats)", ["ray::Read", "ray::_StatsActor", "ray::_AutoscalingCoordinator"]),
    ("worker processes starting or idle", ["ray::IDLE", "setup_worker.py", "default_worker.py"]),
    ("Ray daemons (gcs, raylet, agents)", ["gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env"]),
]


DRIVER = "driver (fit() caller)"


def role_of(title: str) -> str:
    """A process's role by its title (command line)."""
    return next((role for role, keys in ROLES if any(k in title for k in keys)), "other")


class CpuSampler:
    """CPU-seconds per process role between ``start`` and ``stop`` (see the module docstring)."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s, self.running = interval_s, False
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[float, str]] = {}  # pid -> (cpu-s, most telling title seen)

    def _sample(self) -> None:
        for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            try:
                t = p.info["cpu_times"]
                cpu, title = t.user + t.system, " ".join(p.info["cmdline"] or [])
            except (psutil.Error, TypeError, AttributeError):
                continue
            seen = self.last.get(p.info["pid"], (0.0, ""))[1]
            if role_of(title) in ("worker processes starting or idle", "other") and seen:
                title = seen  # keep the actor's title once known: it reads IDLE again as it exits
            self.first.setdefault(p.info["pid"], cpu if not self.running else 0.0)
            self.last[p.info["pid"]] = (cpu, title)

    @staticmethod
    def _busy() -> tuple[float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        return (sum(v) - v[3] - v[4]) / tick, sum(v) / tick  # busy (all but idle, iowait), all

    def start(self) -> None:
        self._sample()  # processes already there count from now; new ones from 0
        self.running, self.busy0 = True, self._busy()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            time.sleep(self.interval_s)
            self._sample()

    def stop(self) -> dict[str, float]:
        self.running = False
        self.thread.join()
        self._sample()
        busy1 = self._busy()
        out = collections.Counter()
        for pid, (cpu, title) in self.last.items():
            out[DRIVER if pid == os.getpid() else role_of(title)] += cpu - self.first.get(pid, 0.0)
        out = {k: v for k, v in out.items() if v >= 0.05}
        out["all processes (sum)"] = sum(out.values())
        out["machine busy (/proc/stat)"] = busy1[0] - self.busy0[0]
        out["machine capacity (cores x wall)"] = busy1[1] - self.busy0[1]
        return out


def one_fit(config: str, overrides: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    from ray_ppo.api import PPOTrainer
    from ray_ppo.config import load_config

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as marks:
        cfg = load_config(config, [f"logging.output_dir={out}", "trainer.total_steps=2", "logging.progress=false",
                                   *overrides])
        sampler = CpuSampler()
        sampler.start()
        start = time.time()
        trainer = PPOTrainer(cfg, experience_maker_factory=TimedMakerFactory(marks),
                             learner_factory=TimedLearnerFactory(marks))
        trainer.fit()
        end = time.time()
        cpu = sampler.stop()
        e = events(marks)
    return cpu, {"makers built": max(e["maker_built"]) - start, "first batch made": min(e["maker_batch"]) - start,
            "rank 0 ready": min(e["rank_ready"]) - start, "first step trained": min(e["train_step"]) - start,
            "fit() total (2 steps + shutdown)": end - start}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--set", nargs="*", default=[], help="extra dotted overrides")
    args = ap.parse_args()
    t = time.time()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # as `ray-ppo train` sets it
    init_ray(num_cpus=8)
    ray_init_s = time.time() - t
    one_fit(args.config, args.set)  # warm-up: the tiny model's build cache, Ray's worker pool
    runs, cpus = [], []
    for _ in range(args.repeats):
        cpu, phases = one_fit(args.config, args.set)
        runs.append(phases)
        cpus.append(cpu)
        print(f"RUN {phases} CPU {cpu}", file=sys.stderr, flush=True)
    print(f"\nStart-up of fit() on {os.path.relpath(args.config, ROOT)} (ray.init once before: {ray_init_s:.1f} s), "
          f"median of {args.repeats} after a warm-up\n")
    publish("startup_phases", ["phase (from the fit() call)", "s (median)", "min", "max"],
                [[k, median([r[k] for r in runs]), min(r[k] for r in runs), max(r[k] for r in runs)] for k in runs[0]], args=args)
    roles = [r for r, _ in ROLES] + [DRIVER, "other", "all processes (sum)", "machine busy (/proc/stat)",
                                     "machine capacity (cores x wall)"]
    print(f"\nCPU-seconds from the fit() call to its return, by process role (median of {args.repeats})\n")
    publish("startup_cpu", ["role", "CPU-s (median)", "min", "max"],
                [[k, median([c.get(k, 0.0) for c in cpus]), min(c.get(k, 0.0) for c in cpus),
                  max(c.get(k, 0.0) for c in cpus)] for k in roles if any(k in c for c in cpus)], args=args)


if __name__ == "__main__":
    main()

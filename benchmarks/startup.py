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
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import _common  # noqa: F401
from _common import ROOT, init_ray, median, table

from ray_ppo.core.build import build_experience_maker
from ray_ppo.core.learner import PPOLearner


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


def one_fit(config: str, overrides: list[str]) -> dict[str, float]:
    from ray_ppo.api import PPOTrainer
    from ray_ppo.config import load_config

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as marks:
        cfg = load_config(config, [f"logging.output_dir={out}", "trainer.total_steps=2", "logging.progress=false",
                                   *overrides])
        start = time.time()
        trainer = PPOTrainer(cfg, experience_maker_factory=TimedMakerFactory(marks),
                             learner_factory=TimedLearnerFactory(marks))
        trainer.fit()
        end = time.time()
        e = events(marks)
    return {"makers built": max(e["maker_built"]) - start, "first batch made": min(e["maker_batch"]) - start,
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
    runs = []
    for _ in range(args.repeats):
        runs.append(one_fit(args.config, args.set))
        print(f"RUN {runs[-1]}", file=sys.stderr, flush=True)
    print(f"\nStart-up of fit() on {os.path.relpath(args.config, ROOT)} (ray.init once before: {ray_init_s:.1f} s), "
          f"median of {args.repeats} after a warm-up\n")
    print(table(["phase (from the fit() call)", "s (median)", "min", "max"],
                [[k, median([r[k] for r in runs]), min(r[k] for r in runs), max(r[k] for r in runs)] for k in runs[0]]))


if __name__ == "__main__":
    main()

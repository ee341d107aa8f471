"""Training on stale experience: ppo.max_staleness x ppo.off_policy on the detached pipeline.

    python benchmarks/staleness.py [--steps 30] [--staleness 1,4,8] [--modes none,tis,decoupled]

Each cell is one ``PPOTrainer.fit()`` of the toy task (configs/tiny.yaml, GAE) on one local Ray
cluster: 3 makers feed 1 trainer worker whose steps are made slow on purpose (4 PPO epochs of 2
minibatches on 32 items), so the makers run ahead as far as admission allows and the buffers
(``topology.buffer_size`` = (S + 1) x 32 items) hold experience up to S versions old. Same seed,
prompts and budget (``--steps`` x 32 samples) in every cell. Prints, per cell: reward over the
first and last 10 steps, the mean staleness actually trained on, the importance-weight statistics
(mean, max over steps, share of tokens above the cap), KL(behaviour || proximal) overall and for
the stalest items, and the median trainer step time (tis and decoupled pay one extra forward pass).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time

import _common
from _common import table

WINDOW = 10


def cell(staleness: int, mode: str, steps: int, root: str) -> list[dict]:
    from ray_ppo.api import PPOTrainer

    cfg = _common.tiny_config(f"{root}/s{staleness}-{mode}", {
        "maker.num_makers": 3, "maker.num_cpus": 0.5, "maker.batch_size": 16,
        "trainer.total_steps": steps, "trainer.train_batch_size": 32, "trainer.mini_batch_size": 16,
        "trainer.ppo_epochs": 4, "ppo.max_staleness": staleness, "ppo.off_policy": mode,
        "topology.buffer_size": (staleness + 1) * 32, "trainer.pull_timeout_s": 300})
    trainer = PPOTrainer(cfg)
    trainer.fit()
    print(".", end="", file=sys.stderr, flush=True)
    return trainer.history


def mean_of(history: list[dict], key: str, rows: slice = slice(None)) -> float:
    values = [m[key] for m in history[rows] if key in m and not math.isnan(m[key])]
    return statistics.fmean(values) if values else float("nan")


def row(staleness: int, mode: str, history: list[dict]) -> list:
    stalest = max((int(k.rsplit("_", 1)[1]) for m in history for k in m if k.startswith("behaviour_kl_stale_")),
                  default=None)
    return [staleness, mode, mean_of(history, "reward_mean", slice(None, WINDOW)),
            mean_of(history, "reward_mean", slice(-WINDOW, None)), mean_of(history, "staleness_mean"),
            max((m["staleness_max"] for m in history), default=float("nan")),
            mean_of(history, "is_weight_mean"), max((m.get("is_weight_max", float("nan")) for m in history), default=float("nan")),
            mean_of(history, "is_capped_frac"), mean_of(history, "behaviour_kl"),
            f"{mean_of(history, f'behaviour_kl_stale_{stalest}'):.3g} (s={stalest})" if stalest is not None else "n/a",
            statistics.median(m["train_s"] for m in history)]


def start_ray(attempts: int = 3):
    """The local cluster; on a machine loaded by others the node may time out while starting."""
    for attempt in range(attempts):
        try:
            return _common.init_ray(num_cpus=8)
        except Exception as e:  # Ray raises a bare Exception for a node start-up timeout
            if attempt == attempts - 1 or "timed out during startup" not in str(e):
                raise
            print(f"Ray start-up timed out ({attempt + 1}/{attempts}), retrying", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", default="1,4,8")
    ap.add_argument("--modes", default="none,tis,decoupled")
    args = ap.parse_args()
    ray = start_ray()
    start = time.perf_counter()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as root:
            for staleness in (int(s) for s in args.staleness.split(",")):
                for mode in args.modes.split(","):
                    rows.append(row(staleness, mode, cell(staleness, mode, args.steps, root)))
    finally:
        ray.shutdown()
    print(file=sys.stderr)
    print(f"Stale experience: toy task, 3 makers : 1 trainer (4 PPO epochs), {args.steps} steps x 32 samples, seed 0\n")
    print(table(["max_staleness", "off_policy", f"reward first {WINDOW}", f"reward last {WINDOW}", "staleness mean",
                 "staleness max", "IS weight mean", "IS weight max", "capped frac", "KL(behav||prox)",
                 "KL, stalest items", "median train_s"], rows))
    print(f"\n({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()

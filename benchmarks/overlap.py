"""Overlap: the detached pipeline (PPOTrainer.fit) vs the synchronous loop (run_local).

    python benchmarks/overlap.py [--repeats 3] [--steps 10] [--skip 3]

Same tiny model, toy task, prompts, batch sizes and samples per step on both sides.
Cores (the machine has 2): the detached run has 1 maker (maker.torch_threads=1) and 1 trainer
worker (trainer.torch_threads=1) on a local ``ray.init(num_cpus=8)`` (logical CPUs; the
coordinator and driver share the same 2 cores); the synchronous run is one process with
``trainer.torch_threads`` = 1 and, as a second row, 2 (all cores to the one process).
Settings: generation-dominated (maker.max_new_tokens=48, ppo_epochs=1, one 64-sample minibatch) and
training-dominated (max_new_tokens=8, ppo_epochs=8) and balanced (max_new_tokens=48, ppo_epochs=2, one
64-sample minibatch: T_gen ~= T_train).
samples/s: steps after the first ``--skip`` (start-up excluded), from ``elapsed_s`` of the
per-step metrics (PPOTrainer.history for the detached run). T_gen and T_train: medians of the
synchronous run's per-step ``generate_s`` and ``train_s``. Ideal ratio = (T_gen + T_train) /
max(T_gen, T_train).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile

from _common import init_ray, median, publish, tiny_config

SETTINGS = {
    "generation-dominated": {"maker.max_new_tokens": 48, "trainer.ppo_epochs": 1, "trainer.mini_batch_size": 64},
    "training-dominated": {"maker.max_new_tokens": 8, "trainer.ppo_epochs": 8},
    # T_gen ~= T_train (issue 15's goal: detached >= 1.3x the synchronous loop here)
    "balanced": {"maker.max_new_tokens": 48, "trainer.ppo_epochs": 2, "trainer.mini_batch_size": 64},
}


def config(setting: str, steps: int, out: str, threads: int = 1):
    return tiny_config(out, {**SETTINGS[setting], "trainer.torch_threads": threads, "trainer.total_steps": steps})


def rate(history: list[dict], skip: int, batch: int) -> float:
    h = sorted(history, key=lambda m: m["step"])
    kept = h[skip:]
    return batch * len(kept) / (kept[-1]["elapsed_s"] - h[skip - 1]["elapsed_s"])


def detached(setting, steps, skip):
    from ray_ppo.api import PPOTrainer
    with tempfile.TemporaryDirectory() as out:
        cfg = config(setting, steps, out)
        trainer = PPOTrainer(cfg)
        trainer.fit()
        h = sorted(trainer.history, key=lambda m: m["step"])
        return {"sps": rate(h, skip, cfg.trainer.train_batch_size),
                "trainer_idle": median([m["trainer_idle_ratio"] for m in h[skip:]]),
                "maker_idle": median([m.get("maker_idle_ratio") for m in h[skip:]]),
                "train_s": median([m["train_s"] for m in h[skip:]]),
                "maker_gen_s": median([m.get("maker_generate_s") for m in h[skip:]]),
                "staleness": median([m["staleness_mean"] for m in h[skip:]]),
                "reward": h[-1]["reward_mean"]}


def synchronous(setting, steps, skip, threads):
    import torch

    from ray_ppo.local import run_local
    with tempfile.TemporaryDirectory() as out:
        cfg = config(setting, steps, out, threads)
        h = run_local(cfg)
        torch.set_num_threads(1)
        return {"sps": rate(h, skip, cfg.trainer.train_batch_size),
                "gen_s": median([m["generate_s"] for m in h[skip:]]),
                "train_s": median([m["train_s"] for m in h[skip:]]), "reward": h[-1]["reward_mean"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args()
    init_ray(num_cpus=8)
    settings = args.settings.split(",")
    runs = collections.defaultdict(list)
    for s in settings:  # warm-up: model build/cache, Ray Train start-up
        synchronous(s, args.skip + 1, args.skip, 1)
    detached(settings[0], args.skip + 2, args.skip)
    for rep in range(args.repeats):  # interleaved: every variant once per round
        for s in settings:
            runs[(s, "det")].append(detached(s, args.steps, args.skip))
            runs[(s, "sync1")].append(synchronous(s, args.steps, args.skip, 1))
            runs[(s, "sync2")].append(synchronous(s, args.steps, args.skip, 2))
            print(f"RUN {s} det={runs[(s, 'det')][-1]} sync1={runs[(s, 'sync1')][-1]} sync2={runs[(s, 'sync2')][-1]}",
                  file=sys.stderr, flush=True)
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = []
    for s in settings:
        d, s1, s2 = runs[(s, "det")], runs[(s, "sync1")], runs[(s, "sync2")]
        det = median([r["sps"] for r in d])
        for name, sync in (("1 thread", s1), ("2 threads", s2)):
            sps = median([r["sps"] for r in sync])
            tg, tt = median([r["gen_s"] for r in sync]), median([r["train_s"] for r in sync])
            ideal = (tg + tt) / max(tg, tt)
            rows.append([s, name, det, sps, det / sps, tg, tt, ideal, det / sps / ideal,
                         median([r["trainer_idle"] for r in d]), median([r["maker_idle"] for r in d]),
                         median([r["train_s"] for r in d]), median([r["maker_gen_s"] for r in d]),
                         median([r["staleness"] for r in d])])
    print(f"Overlap: tiny model, 32 prompts/generation batch, 64 samples/step, {args.steps} steps, first "
          f"{args.skip} excluded, median of {args.repeats} interleaved runs after a warm-up\n")
    publish("overlap", ["setting", "sync threads", "detached samples/s", "sync samples/s", "ratio", "T_gen s (sync)",
                 "T_train s (sync)", "ideal ratio", "ratio / ideal", "trainer_idle_ratio", "maker_idle_ratio",
                 "detached train_s", "detached maker generate_s/step", "staleness"], rows, args=args)


if __name__ == "__main__":
    main()

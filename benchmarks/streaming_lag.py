"""Policy lag of trained tokens: streaming makers with in-flight weight updates against between-batches.

    python benchmarks/streaming_lag.py [--seeds 0,1,2] [--modes batch,between_batches,in_flight,in_flight_recompute]
                                       [--steps 16] [--skip 4]

Each cell is one ``PPOTrainer.fit()`` on one local Ray cluster: the tiny built-in models
(configs/tiny.yaml) on the toy task with GRPO (4 samples a prompt), one maker of 16 prompt
batches feeding one trainer worker, ``maker.max_new_tokens`` 48 so the tiny policy's answers
(they end where it samples its end token) range from one token to the cap. Modes:

- ``batch``: ``maker.max_running: 0``, the batch-by-batch maker (the reference);
- ``between_batches``: streaming (``maker.max_running: 16``), a push swaps in once no sequence runs;
- ``in_flight``: streaming, a push swaps in between two decode steps, the running sequences' caches kept;
- ``in_flight_recompute``: the same with ``maker.kv_at_swap: recompute``.

Per cell, over the steps after the first ``--skip``: the mean of each row's ``token_lag_mean``
(the trainer's version minus the version that sampled each trained token, averaged over the
step's tokens), the max ``token_lag_max``, the mean ``staleness_mean`` (counted on each item's
oldest token), ``swaps_per_sequence``, trained samples per second (``elapsed_s`` between the
first measured step and the last), and the makers' slot utilisation. The table gives the mean
over seeds and the spread (min-max) of the lag and of samples/s; the ratio of the in-flight lag
to the between-batches lag is the issue's goal (<= 0.5 at equal or higher samples/s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import _common
from _common import publish

MODES = {
    "batch": {"maker.max_running": 0},
    "between_batches": {"maker.max_running": 16, "maker.weight_updates": "between_batches"},
    "in_flight": {"maker.max_running": 16, "maker.weight_updates": "in_flight", "maker.kv_at_swap": "keep"},
    "in_flight_recompute": {"maker.max_running": 16, "maker.weight_updates": "in_flight",
                            "maker.kv_at_swap": "recompute"},
}


def cell(mode: str, seed: int, steps: int, root: str) -> list[dict]:
    from ray_ppo.api import PPOTrainer

    cfg = _common.tiny_config(f"{root}/{mode}-{seed}", {
        **MODES[mode], "seed": seed, "maker.num_makers": 1, "maker.batch_size": 16, "maker.samples_per_prompt": 4,
        "maker.max_new_tokens": 48, "algo.advantage": "grpo", "trainer.total_steps": steps,
        "trainer.train_batch_size": 32, "trainer.mini_batch_size": 16, "ppo.max_staleness": 2,
        "trainer.pull_timeout_s": 300})
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return trainer.history


def measure(history: list[dict], skip: int) -> dict[str, float]:
    rows = history[skip:]
    samples = 32 * (len(rows) - 1)
    span = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]
    utilisation = [m["maker_slot_utilisation"] for m in rows if "maker_slot_utilisation" in m]
    return {"lag": statistics.fmean(m["token_lag_mean"] for m in rows),
            "lag_max": max(m["token_lag_max"] for m in rows),
            "staleness": statistics.fmean(m["staleness_mean"] for m in rows),
            "swaps": statistics.fmean(m["swaps_per_sequence"] for m in rows),
            "samples_per_s": samples / span,
            "length": statistics.fmean(m["response_length"] for m in rows),
            "slots": statistics.fmean(utilisation) if utilisation else float("nan")}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=4)
    args = ap.parse_args()
    if _common.quick():
        args.seeds, args.steps, args.skip = "0", 6, 2
    seeds, modes = [int(s) for s in args.seeds.split(",")], args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    ray = _common.init_ray(num_cpus=8)
    start = time.perf_counter()
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        with tempfile.TemporaryDirectory() as root:
            for seed in seeds:  # seeds outermost: the modes interleave, so a load change hits them alike
                for mode in modes:
                    results[mode].append(measure(cell(mode, seed, args.steps, root), args.skip))
                    print(f"seed {seed} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    reference = statistics.fmean(r["lag"] for r in results["between_batches"]) if "between_batches" in results else None
    rows = []
    for mode in modes:
        rs = results[mode]
        lag = statistics.fmean(r["lag"] for r in rs)
        rows.append([mode, spread([r["lag"] for r in rs]), max(r["lag_max"] for r in rs),
                     round(statistics.fmean(r["staleness"] for r in rs), 3),
                     round(statistics.fmean(r["swaps"] for r in rs), 3), spread([r["samples_per_s"] for r in rs]),
                     round(statistics.fmean(r["slots"] for r in rs), 3),
                     round(statistics.fmean(r["length"] for r in rs), 1),
                     round(lag / reference, 2) if reference else "n/a"])
    publish("streaming_lag", ["mode", "token lag mean (min-max)", "token lag max", "staleness mean",
                              "swaps / sequence", "samples/s (min-max)", "slot utilisation", "response length",
                              "lag / between_batches"], rows, args=args,
            title=f"Policy lag of trained tokens: tiny models, toy task, GRPO x4, 1 maker : 1 trainer, "
                  f"{args.steps} steps x 32 samples (first {args.skip} left out), seeds {args.seeds}")
    print(f"\n({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()

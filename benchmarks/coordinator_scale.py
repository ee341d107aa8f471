"""Coordinator scale: the real ``Coordinator`` actor, fake makers and fake trainer ranks.

    python benchmarks/coordinator_scale.py [--repeats 3] [--items 4096] [--profile]

Makers are simulated by async "maker group" actors (at most 8 processes; each runs its share of
the logical makers as concurrent coroutines, every one calling ``Coordinator.send`` with its own
maker id, one batch of 32 items at a time and waiting for the answer, as ``MakerWorker.send_loop``
does). Ranks are actors calling ``Coordinator.pull(rank, 32, ...)`` in a loop, as the train loop
does. Items are realistic ``ExperienceItem``s of about 1 KB of tensor data (16 prompt tokens, 24
response tokens, six float32 per-token fields), built before the clock starts.

Variants (all through the unmodified ``Coordinator``):
  torch   ExperienceItem with torch tensors (what makers send today)
  numpy   the same items with NumPy arrays instead of torch tensors
  packed  one object per 32-item batch (NumPy arrays concatenated + offsets), sent and pulled
          as a single "item": per-call batching without per-item Python work
items/s counts real samples (32 per packed object). Every uid is checked at the end: none lost,
none duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import pstats
import sys
import time
from dataclasses import dataclass, replace

import _common  # noqa: F401  (sys.path)
from _common import init_ray, median, table

import numpy as np
import ray

from ray_ppo.coordinator import Coordinator

BATCH = 32
P_LEN, R_LEN = 16, 24
FIELDS = ("action_log_probs", "ref_log_probs", "values", "rewards", "advantages", "returns")


@dataclass
class PackedItems:
    """A maker batch as one object: flat arrays + offsets (the 'after' design)."""

    prompt_ids: np.ndarray
    prompt_offsets: np.ndarray
    response_ids: np.ndarray
    response_offsets: np.ndarray
    per_token: np.ndarray      # (6, total_response_tokens) float32
    reward: np.ndarray
    uids: list
    policy_version: int = 0

    def __len__(self):
        return len(self.uids)


def make_items(variant: str, maker_id: int, batch_index: int):
    import torch
    from ray_ppo.algo import ExperienceItem

    uids = [f"{maker_id}-{batch_index}-{i}" for i in range(BATCH)]
    rng = np.random.default_rng(maker_id * 100003 + batch_index)
    if variant == "packed":
        return [PackedItems(
            prompt_ids=rng.integers(0, 50000, BATCH * P_LEN), prompt_offsets=np.arange(0, BATCH * P_LEN + 1, P_LEN),
            response_ids=rng.integers(0, 50000, BATCH * R_LEN), response_offsets=np.arange(0, BATCH * R_LEN + 1, R_LEN),
            per_token=rng.standard_normal((len(FIELDS), BATCH * R_LEN), dtype=np.float32),
            reward=rng.standard_normal(BATCH, dtype=np.float32), uids=uids)]
    conv = torch.from_numpy if variant == "torch" else (lambda a: a)
    items = []
    for uid in uids:
        items.append(ExperienceItem(
            prompt_ids=conv(rng.integers(0, 50000, P_LEN)), response_ids=conv(rng.integers(0, 50000, R_LEN)),
            **{f: conv(rng.standard_normal(R_LEN, dtype=np.float32)) for f in FIELDS},
            reward=float(rng.standard_normal()), policy_version=0, uid=uid))
    return items


def item_bytes() -> int:
    return P_LEN * 8 + R_LEN * 8 + len(FIELDS) * R_LEN * 4


class BenchCoordinator(Coordinator):
    """The real Coordinator plus probes (process, RSS, CPU time, cProfile)."""

    def probe(self) -> dict:
        import os
        import resource
        with open("/proc/self/status") as f:
            rss = next(int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:"))
        return {"pid": os.getpid(), "rss_mb": rss, "cpu_s": time.process_time(),
                "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    def profile_start(self) -> None:
        self._prof = cProfile.Profile()
        self._prof.enable()

    def profile_stop(self, top: int = 25) -> str:
        self._prof.disable()
        out = io.StringIO()
        pstats.Stats(self._prof, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()


@ray.remote(num_cpus=0)
class MakerGroup:
    def prepare(self, variant: str, maker_ids: list[int], batches: int) -> int:
        self.batches = {m: [make_items(variant, m, b) for b in range(batches)] for m in maker_ids}
        return sum(len(b) for bs in self.batches.values() for b in bs)

    async def run(self, coordinator) -> float:
        async def one(maker_id: int):
            for items in self.batches[maker_id]:
                await coordinator.send.remote(maker_id, items, {"num_prompts": 0})
        await asyncio.gather(*(one(m) for m in self.batches))
        self.batches = {}
        return time.time()


@ray.remote(num_cpus=0)
class Flag:
    def __init__(self):
        self.value = False

    def set(self, value: bool) -> None:
        self.value = value

    def get(self) -> bool:
        return self.value


@ray.remote(num_cpus=0)
class Rank:
    def run(self, coordinator, rank: int, n: int, timeout_s: float, done) -> tuple[list, float, int]:
        uids, last, calls = [], None, 0
        while True:
            try:
                got = ray.get(coordinator.pull.remote(rank, n, 0, timeout_s))
            except ray.exceptions.RayTaskError:  # no complete batch within timeout_s (items are put back)
                if ray.get(done.get.remote()):
                    break  # the makers are done: what is left is drained by the driver
                continue
            calls += 1
            last = time.time()
            for it in got:
                uids.extend(it.uids if isinstance(it, PackedItems) else [it.uid])
        return uids, last, calls


def run_once(groups, ranks, done, variant: str, num_makers: int, num_ranks: int, total_items: int, profile: bool = False):
    batches = max(1, total_items // (BATCH * num_makers))
    per_item = BATCH if variant == "packed" else 1
    n_pull = BATCH // per_item  # 32 samples per pull
    coord = ray.remote(num_cpus=0)(BenchCoordinator).remote(
        num_ranks=num_ranks, num_makers=num_makers, buffer_size=2 * BATCH // per_item, max_staleness=10**9,
        items_per_version=10**12, routing="round_robin")
    ray.get([coord.ready.remote(), done.set.remote(False)])
    # logical makers spread over the maker-group processes
    share = collections.defaultdict(list)
    for m in range(num_makers):
        share[m % len(groups)].append(m)
    expected = sum(ray.get([groups[g].prepare.remote(variant, ms, batches) for g, ms in share.items()])) * per_item
    before = ray.get(coord.probe.remote())
    if profile:
        ray.get(coord.profile_start.remote())
    t0 = time.time()
    sent_refs = [groups[g].run.remote(coord) for g in share]
    rank_refs = [ranks[r].run.remote(coord, r, n_pull, 0.5, done) for r in range(num_ranks)]
    ray.get(sent_refs)
    ray.get(done.set.remote(True))
    results = ray.get(rank_refs)
    prof = ray.get(coord.profile_stop.remote()) if profile else None
    after = ray.get(coord.probe.remote())
    status = ray.get(coord.status.remote())
    # leftovers (< one pull per rank when the makers stopped) are drained outside the clock
    leftover = []
    for r, k in enumerate(status["buffered"]):
        if k:
            for it in ray.get(coord.pull.remote(r, k, 0, 5.0)):
                leftover.extend(it.uids if isinstance(it, PackedItems) else [it.uid])
    uids = [u for res in results for u in res[0]]
    t_end = max(res[1] for res in results if res[1] is not None)
    all_uids = uids + leftover
    ray.kill(coord)
    n = len(uids)
    wall = t_end - t0
    return {"items_per_s": n / wall, "mb_per_s": n * item_bytes() / wall / 1e6, "us_per_item": 1e6 * wall / n,
            "coord_cpu_us": 1e6 * (after["cpu_s"] - before["cpu_s"]) / n, "rss_mb": after["rss_mb"],
            "expected": expected, "received": len(all_uids), "unique": len(set(all_uids)),
            "lost": expected - len(set(all_uids)), "dup": len(all_uids) - len(set(all_uids)), "profile": prof}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--items", type=int, default=4096, help="samples per run (half for the slow torch items)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the coordinator at 16 makers x 4 ranks")
    args = ap.parse_args()
    init_ray(num_cpus=8)
    groups = [MakerGroup.remote() for _ in range(8)]
    ranks = [Rank.remote() for _ in range(8)]
    done = Flag.remote()
    ray.get([a.__ray_ready__.remote() for a in groups + ranks + [done]])
    grid = [("torch", m, r) for m, r in [(1, 1), (4, 1), (16, 1), (64, 1), (4, 4), (16, 4), (64, 4), (16, 8), (64, 8)]]
    grid += [("numpy", 16, 4), ("packed", 16, 4), ("packed", 64, 8)]
    run_once(groups, ranks, done, "torch", 4, 2, 1024)  # warm-up
    runs = collections.defaultdict(list)
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for cfg in grid:
            runs[cfg].append(run_once(groups, ranks, done, *cfg, args.items if cfg[0] != "torch" else args.items // 2))
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = []
    for cfg in grid:
        rs = runs[cfg]
        rows.append([cfg[0], cfg[1], cfg[2], median([r["items_per_s"] for r in rs]), median([r["mb_per_s"] for r in rs]),
                     median([r["us_per_item"] for r in rs]), median([r["coord_cpu_us"] for r in rs]),
                     max(r["rss_mb"] for r in rs), sum(r["expected"] for r in rs), sum(r["unique"] for r in rs),
                     sum(r["lost"] for r in rs), sum(r["dup"] for r in rs)])
    print(f"Coordinator scale: {item_bytes()} B of tensor data per item, 32 items per send/pull, "
          f"~{args.items} items per run, median of {args.repeats} interleaved runs after a warm-up\n")
    print(table(["items", "makers", "ranks", "items/s", "MB/s", "wall us/item", "coordinator CPU us/item",
                 "coordinator RSS MiB", "sent (all runs)", "received unique", "lost", "duplicated"], rows))
    # where the per-item time goes: Ray's serializer on one 32-item batch, in this process
    ser = {}
    for variant in ("torch", "numpy", "packed"):
        batch = make_items(variant, 0, 0)
        times = []
        for _ in range(7):
            t = time.perf_counter()
            ray.get(ray.put(batch))
            times.append(time.perf_counter() - t)
        ser[variant] = 1e6 * median(times[2:]) / BATCH
    print("\nray.put + ray.get of one 32-item batch in one process (serialize + deserialize), us per item: "
          + ", ".join(f"{k} {v:.0f}" for k, v in ser.items())
          + ". An item crosses this 2x on its way (maker -> coordinator -> rank).")
    if args.profile:
        print("\ncProfile of the coordinator (torch items, 16 makers x 4 ranks):\n", file=sys.stderr)
        print(run_once(groups, ranks, done, "torch", 16, 4, args.items // 2, profile=True)["profile"], file=sys.stderr)


if __name__ == "__main__":
    main()

"""Coordinator scale: the real ``Coordinator`` actor, fake makers and fake trainer ranks.

    python benchmarks/coordinator_scale.py [--repeats 3] [--items 8192] [--profile]

Makers are simulated by async "maker group" actors (at most 8 processes; each runs its share of
the logical makers as concurrent coroutines, every one sending one batch of 32 items at a time
with its own maker id and waiting for the answer, as ``MakerWorker.send_loop`` does). Ranks are
actors that pull 32 items at a time and turn what they get into ``ExperienceItem``s, as the
train loop's ``_pull`` does. Items are realistic ``ExperienceItem``s with torch tensors, about
1 KB of tensor data each (16 prompt tokens, 24 response tokens, six float32 per-token fields),
built before the clock starts; packing them is the makers' work and is inside the clock.

Variants (the real ``Coordinator`` and ``ray_ppo.wire.transport``, as ``topology.transport`` sets them):
  inline  the default: the maker packs the batch into the call (``ExperienceChunk.inline``); the
          coordinator deserializes it and serializes it again for the rank
  ref     the maker packs the batch and ``ray.put``s it (``ExperienceChunk.stored``), the coordinator
          routes the chunk (a ref, a count, a version), the rank fetches it (``resolve``)
Batches of 32 items (a maker's generation batch, a rank's pull), and 128 in two rows.
items/s counts items the ranks hold as ``ExperienceItem``s. Every uid is checked at the end:
none lost, none duplicated.
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

import numpy as np
import ray

import _common  # noqa: F401  (sys.path)
from _common import init_ray, median, publish, quick
from ray_ppo.cluster.handles import fetch_objects, put_object
from ray_ppo.coordinator.actor import Coordinator
from ray_ppo.makers.testing import coordinator_config
from ray_ppo.wire.messages import MakerStats, PullRequest
from ray_ppo.wire.transport import ExperienceChunk, resolve

BATCH = 32
P_LEN, R_LEN = 16, 24


HEADLINE = ("inline", 16, 4, BATCH)
"""The configuration of the summary's goal: 16 makers x 4 ranks, one batch of 32 items per call."""


def make_items(maker_id: int, batch_index: int, batch: int = BATCH):
    import torch

    from ray_ppo.algo import ExperienceItem

    rng = np.random.default_rng(maker_id * 100003 + batch_index)
    return [ExperienceItem.filled(
        torch.from_numpy(rng.integers(0, 50000, P_LEN)), torch.from_numpy(rng.integers(0, 50000, R_LEN)),
        lambda name: torch.from_numpy(rng.standard_normal(R_LEN, dtype=np.float32)),
        reward=float(rng.standard_normal()), policy_version=0, uid=f"{maker_id}-{batch_index}-{i}") for i in range(batch)]


def item_bytes() -> int:
    from ray_ppo.algo.experience import PER_TOKEN_FIELDS

    return P_LEN * 8 + R_LEN * 8 + len(PER_TOKEN_FIELDS) * R_LEN * 4


class BenchCoordinator(Coordinator):
    """The real Coordinator plus probes (process, RSS, CPU time, cProfile)."""

    def probe(self) -> dict:
        import os
        import resource
        with open("/proc/self/status") as f:
            rss = next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS:"))
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
    def prepare(self, maker_ids: list[int], batches: int, batch: int) -> int:
        self.batches = {m: [make_items(m, b, batch) for b in range(batches)] for m in maker_ids}
        return sum(len(b) for bs in self.batches.values() for b in bs)

    async def run(self, coordinator, variant: str) -> float:
        async def one(maker_id: int):
            for items in self.batches[maker_id]:
                chunk = ExperienceChunk.of(items, variant, put=put_object)
                await coordinator.send.remote(maker_id, chunk, MakerStats())
        await asyncio.gather(*(one(m) for m in self.batches))
        return time.time()

    def release(self) -> None:
        """Drop the batches (and with them, for ``ref``, the makers' hold on the objects)."""
        self.batches = {}


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
                request = PullRequest(rank=rank, n=n, trainer_version=0, timeout_s=timeout_s)
                chunks = ray.get(coordinator.pull.remote(request)).chunks
            except ray.exceptions.RayTaskError:  # no complete batch within timeout_s (items are put back)
                if ray.get(done.get.remote()):
                    break  # the makers are done: what is left is drained by the driver
                continue
            items, lost, _ = resolve(chunks, fetch_objects)
            assert lost == 0
            calls += 1
            last = time.time()
            uids.extend(it.uid for it in items)
        return uids, last, calls


def run_once(groups, ranks, done, variant: str, num_makers: int, num_ranks: int, batch: int, total_items: int,
             profile: bool = False):
    batches = max(1, total_items // (batch * num_makers))
    coord = ray.remote(num_cpus=0)(BenchCoordinator).remote(coordinator_config(
        num_ranks=num_ranks, num_makers=num_makers, buffer_size=2 * batch, max_staleness=10**9,
        items_per_version=num_ranks * 10**12, routing="round_robin"))
    ray.get([coord.ready.remote(), done.set.remote(False)])
    # logical makers spread over the maker-group processes
    share = collections.defaultdict(list)
    for m in range(num_makers):
        share[m % len(groups)].append(m)
    expected = sum(ray.get([groups[g].prepare.remote(ms, batches, batch) for g, ms in share.items()]))
    before = ray.get(coord.probe.remote())
    if profile:
        ray.get(coord.profile_start.remote())
    t0 = time.time()
    sent_refs = [groups[g].run.remote(coord, variant) for g in share]
    rank_refs = [ranks[r].run.remote(coord, r, batch, 0.5, done) for r in range(num_ranks)]
    ray.get(sent_refs)
    ray.get(done.set.remote(True))
    results = ray.get(rank_refs)
    prof = ray.get(coord.profile_stop.remote()) if profile else None
    after = ray.get(coord.probe.remote())
    status = ray.get(coord.status.remote())
    # leftovers (< one pull per rank when the makers stopped) are drained outside the clock
    leftover = []
    for r, k in enumerate(status.buffered):
        if k:
            request = PullRequest(rank=r, n=k, trainer_version=0, timeout_s=5.0)
            leftover.extend(it.uid for it in resolve(ray.get(coord.pull.remote(request)).chunks, fetch_objects).items)
    ray.get([groups[g].release.remote() for g in share])
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
    ap.add_argument("--items", type=int, default=8192, help="items per run")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the coordinator at 16 makers x 4 ranks")
    ap.add_argument("--grid", choices=("all", "headline"), default="headline" if quick() else "all",
                    help="every configuration, or the headline one (inline, 16 makers x 4 ranks; the quick run's)")
    args = ap.parse_args()
    init_ray(num_cpus=8)
    groups = [MakerGroup.remote() for _ in range(8)]
    ranks = [Rank.remote() for _ in range(8)]
    done = Flag.remote()
    ray.get([a.__ray_ready__.remote() for a in groups + ranks + [done]])
    grid = [("inline", m, r, BATCH) for m, r in [(1, 1), (4, 1), (16, 1), (64, 1), (4, 4), (16, 4), (64, 4), (16, 8), (64, 8)]]
    grid += [("ref", 16, 4, BATCH), ("ref", 64, 8, BATCH), ("inline", 16, 4, 4 * BATCH), ("ref", 16, 4, 4 * BATCH)]
    if args.grid == "headline":
        grid = [HEADLINE]
    # Warm-up on every maker group and rank process: each imports the coordinator's module when it
    # first gets a coordinator handle, which would otherwise land inside the first timed run using it.
    run_once(groups, ranks, done, "inline", len(groups), len(ranks), BATCH, 4096)
    runs = collections.defaultdict(list)
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for cfg in grid:
            runs[cfg].append(run_once(groups, ranks, done, *cfg, args.items))
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = []
    for cfg in grid:
        rs = runs[cfg]
        rows.append([cfg[0], cfg[1], cfg[2], cfg[3], median([r["items_per_s"] for r in rs]), median([r["mb_per_s"] for r in rs]),
                     median([r["us_per_item"] for r in rs]), median([r["coord_cpu_us"] for r in rs]),
                     max(r["rss_mb"] for r in rs), sum(r["expected"] for r in rs), sum(r["unique"] for r in rs),
                     sum(r["lost"] for r in rs), sum(r["dup"] for r in rs)])
    title = (f"Coordinator scale: {item_bytes()} B of tensor data per item, one batch per send and per pull, "
             f"{args.items} items per run, median of {args.repeats} interleaved runs after a warm-up")
    publish("coordinator_scale", ["variant", "makers", "ranks", "items per batch", "items/s", "MB/s", "wall us/item",
                                  "coordinator CPU us/item", "coordinator RSS MiB", "sent (all runs)", "received unique",
                                  "lost", "duplicated"], rows, args=args, title=title)
    if args.profile:
        print("\ncProfile of the coordinator (inline, 16 makers x 4 ranks):\n", file=sys.stderr)
        print(run_once(groups, ranks, done, "inline", 16, 4, BATCH, args.items, profile=True)["profile"], file=sys.stderr)


if __name__ == "__main__":
    main()

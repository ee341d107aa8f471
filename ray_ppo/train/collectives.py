"""The collectives of a training step, named for what they synchronise across the trainer's ranks.

Each is a no-op in a single process (no process group, or a world of one). Every rank must call
each one at the same point of the step, or the group hangs.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

SUMMED_METRICS = frozenset({"fault_count"})
"""Counts of the whole worker group: summed over the ranks, not averaged."""


def multi_rank() -> bool:
    """Whether a process group of more than one rank exists."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def all_reduce_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """A step's metrics over the ranks: the mean (the max for ``*_max`` keys, the sum for
    ``SUMMED_METRICS``). A nan (a statistic a rank has no data for, e.g. ``behaviour_kl_stale_<s>``)
    is left out: nan only when every rank has nan."""
    return start_all_reduce_metrics(metrics, device)()


def start_all_reduce_metrics(metrics: dict[str, float], device: torch.device) -> Callable[[], dict[str, float]]:
    """``all_reduce_metrics`` started, not waited for: returns the call that waits for it and gives
    the reduced metrics. One all-gather (asynchronous), the means and maxes taken locally: a
    collective costs milliseconds on a gloo group whatever its size, and waiting for it would also
    hold each rank until the slowest one reached it. Every rank must start it at the same point of
    the step, and finish it (from any thread)."""
    if not multi_rank():
        return lambda: dict(metrics)
    keys = sorted(metrics)  # every rank reports the same keys
    mine = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    work = torch.distributed.all_gather(every, mine, async_op=True)

    def finish() -> dict[str, float]:
        work.wait()
        values = torch.stack(every).cpu()  # (ranks, keys)
        missing = torch.isnan(values)
        means = torch.nanmean(values, dim=0)  # nan where every rank has nan
        maxes = values.masked_fill(missing, float("-inf")).amax(dim=0).masked_fill(missing.all(dim=0), float("nan"))
        sums = torch.nansum(values, dim=0).masked_fill(missing.all(dim=0), float("nan"))
        return {k: float(maxes[i] if k.endswith("_max") else sums[i] if k in SUMMED_METRICS else means[i])
                for i, k in enumerate(keys)}

    return finish


def broadcast_time_up(budget_s: float, run_start: float, device: torch.device) -> bool:
    """Broadcast of rank 0's clock: whether the loop has run ``budget_s`` seconds (0 = no budget),
    decided alike on every rank (no collective without a budget)."""
    if not budget_s:
        return False
    over = torch.tensor([float(time.perf_counter() - run_start >= budget_s)], device=device)
    if multi_rank():
        torch.distributed.broadcast(over, src=0)
    return bool(over.item())


def broadcast_from_rank_0(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank; the other ranks wait here until rank 0 has sent it."""
    if not multi_rank():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.broadcast(t, src=0)
    return int(t.item())

"""The collectives of a training step, named for what they synchronise across the trainer's ranks.

Each is a no-op in a single process (no process group, or a world of one). Every rank must call
each one at the same point of the step, or the group hangs.
"""

from __future__ import annotations

import time

import torch


def multi_rank() -> bool:
    """Whether a process group of more than one rank exists."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def all_reduce_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """All-reduce of a step's metrics: mean over ranks (max for ``*_max`` keys). A nan (a statistic
    a rank has no data for, e.g. ``behaviour_kl_stale_<s>``) is left out of the mean: nan only
    when every rank has nan."""
    if not multi_rank():
        return metrics
    keys = sorted(metrics)
    means = [k for k in keys if not k.endswith("_max")]
    maxes = [k for k in keys if k.endswith("_max")]
    out = dict(metrics)
    if means:
        t = torch.tensor([metrics[k] for k in means], dtype=torch.float64, device=device)
        t = torch.stack([torch.nan_to_num(t, nan=0.0), (~torch.isnan(t)).double()])
        torch.distributed.all_reduce(t)
        out.update(zip(means, (t[0] / t[1]).tolist()))  # 0 / 0 = nan where no rank had a value
    if maxes:
        t = torch.tensor([metrics[k] for k in maxes], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        out.update(zip(maxes, t.tolist()))
    return out


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

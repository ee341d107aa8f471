"""The step's metrics collective on a real two-process gloo group (``torch.multiprocessing``)."""

import math
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_ppo.core.collectives import all_reduce_metrics

ROWS = [  # what each rank's step measured
    {"loss": 1.0, "staleness_max": 2.0, "behaviour_kl_stale_3": float("nan"), "reward_max": float("nan"),
     "only_nan": float("nan")},
    {"loss": 3.0, "staleness_max": 5.0, "behaviour_kl_stale_3": 0.25, "reward_max": 0.5,
     "only_nan": float("nan")},
]


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(ROWS))
    try:
        out[rank] = all_reduce_metrics(ROWS[rank], torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_averaged_or_maxed_over_ranks_leaving_out_nan():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), out), nprocs=len(ROWS))
        got = dict(out)
    assert {k: repr(v) for k, v in got[0].items()} == {k: repr(v) for k, v in got[1].items()}  # one row everywhere
    row = got[0]
    assert row["loss"] == 2.0 and row["staleness_max"] == 5.0
    assert row["behaviour_kl_stale_3"] == 0.25 and row["reward_max"] == 0.5  # a rank's nan is left out
    assert math.isnan(row["only_nan"])  # nan only when no rank had a value


def test_one_process_keeps_its_own_metrics():
    assert all_reduce_metrics({"loss": 1.5}, torch.device("cpu")) == {"loss": 1.5}

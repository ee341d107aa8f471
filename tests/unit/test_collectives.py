"""The step's collectives on a real two-process gloo group (``torch.multiprocessing``)."""

import math
import os
import socket
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_ppo.algo import ExperienceBatch, ExperienceItem, make_kl_controller
from ray_ppo.train.collectives import all_reduce_metrics, start_all_reduce_metrics
from ray_ppo.train.loop import _train

ROWS = [  # what each rank's step measured
    {"loss": 1.0, "staleness_max": 2.0, "behaviour_kl_stale_3": float("nan"), "reward_max": float("nan"),
     "only_nan": float("nan"), "fault_count": 1.0},
    {"loss": 3.0, "staleness_max": 5.0, "behaviour_kl_stale_3": 0.25, "reward_max": 0.5,
     "only_nan": float("nan"), "fault_count": 2.0},
]


def _rank(rank: int, port: int, out: dict, job=None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(ROWS))
    try:
        out[rank] = (job or _metrics)(rank)
    finally:
        dist.destroy_process_group()


def _metrics(rank: int) -> dict:
    return all_reduce_metrics(ROWS[rank], torch.device("cpu"))


KL = [0.5, 3.5]  # each rank's experience KL: one under the target, one over it
TARGET, HORIZON, BATCH = 1.0, 100, 4


class NoUpdate:
    """A learner whose step changes nothing: ``_train`` around it is what is tested."""

    kl_coef = 0.0

    def train_step(self, batch, version=None):
        return {"policy_loss": 0.0}


def _adaptive_kl_step(rank: int) -> float:
    """One ``_train`` on this rank's items; the coefficient its KL controller holds after it."""
    cfg = SimpleNamespace(trainer=SimpleNamespace(train_batch_size=BATCH), ppo=SimpleNamespace(uses_reference=True))
    w = SimpleNamespace(cfg=cfg, learner=NoUpdate(), world=len(KL), device=torch.device("cpu"),
                        kl_ctl=make_kl_controller(0.1, kl_target=TARGET, kl_horizon=HORIZON),
                        tokenizer=SimpleNamespace(pad_token_id=0))
    items = [ExperienceItem.filled(torch.tensor([1, 2]), torch.tensor([3, 4, 5]),
                                   per_token=lambda name: torch.full((3,), KL[rank] if name == "action_log_probs" else 0.0),
                                   reward=0.0, policy_version=1, uid=f"{rank}-{i}") for i in range(BATCH)]
    metrics = _train(w, 1, items, ExperienceBatch.merge(items, 0))
    assert metrics["kl"] == KL[rank]  # the rank's own KL is what it reports; the row's mean comes later
    return w.kl_ctl.value


def _spawn(job=None) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), out, job), nprocs=len(ROWS))
        return dict(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_averaged_maxed_or_summed_over_ranks_leaving_out_nan():
    got = _spawn()
    assert {k: repr(v) for k, v in got[0].items()} == {k: repr(v) for k, v in got[1].items()}  # one row everywhere
    row = got[0]
    assert row["loss"] == 2.0 and row["staleness_max"] == 5.0 and row["fault_count"] == 3.0
    assert row["behaviour_kl_stale_3"] == 0.25 and row["reward_max"] == 0.5  # a rank's nan is left out
    assert math.isnan(row["only_nan"])  # nan only when no rank had a value


LATE_S = 1.0  # how late rank 0 reaches the metrics all-gather


def _started_metrics(rank: int) -> tuple[float, dict]:
    """Rank 0 starts the all-gather ``LATE_S`` late; how long starting it held this rank, and its row."""
    if rank == 0:
        time.sleep(LATE_S)
    start = time.perf_counter()
    finish = start_all_reduce_metrics(ROWS[rank], torch.device("cpu"))
    held_s = time.perf_counter() - start
    return held_s, finish()


def test_a_rank_that_starts_the_metrics_all_gather_goes_on_without_waiting_for_the_slower_rank():
    got = _spawn(_started_metrics)
    (_, row0), (held_s, row1) = got[0], got[1]
    assert held_s < LATE_S / 2  # rank 1 was not held until rank 0 came
    assert row1["loss"] == row0["loss"] == 2.0 and row1["staleness_max"] == 5.0  # and got the same row


def test_one_process_keeps_its_own_metrics():
    assert all_reduce_metrics({"loss": 1.5}, torch.device("cpu")) == {"loss": 1.5}


def test_an_adaptive_kl_coefficient_moves_alike_on_every_rank():
    """Each rank's KL alone would move its coefficient apart (rank 0 down, rank 1 up); the
    controller sees the mean over ranks, so the coefficient rank 0 pushes and checkpoints is the
    one every rank's KL loss uses."""
    got = _spawn(_adaptive_kl_step)
    expected = make_kl_controller(0.1, kl_target=TARGET, kl_horizon=HORIZON)
    expected.update(sum(KL) / len(KL), BATCH * len(KL))
    assert got[0] == got[1] == expected.value != 0.1

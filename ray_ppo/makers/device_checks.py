"""What the maker device tests (``tests/unit/test_maker_device.py``) and the GPU check
(``scripts/gpu_check.py``) share: a trainer's push of perturbed weights, delivered to a
``MakerWorker`` as the coordinator relays one, and the check that items come back on the CPU
with finite values. Torch only (the GPU check imports the maker behind a stand-in ``ray``)."""

from __future__ import annotations

import copy
import itertools
from typing import Any, Iterable

import torch

from ray_ppo.models.sync import Bucket, bucket_nbytes, join_state, make_buckets, push_aliases
from ray_ppo.wire.messages import PushHeader


def perturbed_push(worker: Any, scale: float, bucket_mb: float, seed: int = 1) -> tuple[dict[str, torch.Tensor], list[Bucket]]:
    """(the trainer's full state, the buckets of its push as a maker reads them from the object
    store) for CPU copies of ``worker``'s models with ``scale``-sized noise added; tied aliases are
    left out of the push, as the trainer's ``WeightPublisher.to_push`` does."""
    policy = copy.deepcopy(worker.float_policy).cpu()
    critic = copy.deepcopy(worker.maker.critic).cpu() if worker.maker.critic is not None else None
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in itertools.chain(policy.parameters(), critic.parameters() if critic is not None else ()):
            p.add_(scale * torch.randn_like(p))
    full = join_state(policy.state_dict(), critic.state_dict() if critic is not None else {})
    aliases = push_aliases(policy, critic)
    push = {k: v for k, v in full.items() if k not in aliases}
    return full, [as_stored(bucket) for bucket in make_buckets(push, bucket_mb)]


def as_stored(bucket: Bucket) -> Bucket:
    """A bucket as a maker gets it from the object store: its own copy of the bytes, read-only."""
    metas, arrays = bucket
    copies = [array.copy() for array in arrays]
    for array in copies:
        array.setflags(write=False)
    return metas, copies


def deliver_push(worker: Any, version: int, buckets: list[Bucket]) -> bool:
    """Stage ``buckets`` as push ``version`` the way ``weights_start`` / ``weights_chunk`` /
    ``weights_end`` do (each bucket already fetched); whether the maker loaded it."""
    worker.weights_start(PushHeader(version, len(buckets), sum(bucket_nbytes(b) for b in buckets),
                                    kl_coef=worker.cfg.ppo.kl_coef))
    for index, bucket in enumerate(buckets):
        worker.receiver.staging.add(index, bucket)  # weights_chunk, after its ray.get of the bucket's ref
    return worker.weights_end(version)


def bad_item_fields(items: Iterable) -> list[str]:
    """Names of item tensors that are not on the CPU or not finite (empty when all is well)."""
    return [name for item in items for name, t in vars(item).items()
            if isinstance(t, torch.Tensor) and (t.device.type != "cpu" or not torch.isfinite(t.float()).all())]

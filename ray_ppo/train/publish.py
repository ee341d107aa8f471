"""Trainer side of a weight push: gather the full weights (a collective), cut them into buckets,
put each in the object store once and hand its ref to the coordinator at once, so makers stage
bucket k while rank 0 puts k+1. The bucket format and the maker side are in ``ray_ppo.models.sync``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ray_ppo.models.lora import trainable_names
from ray_ppo.models.sync import join_state, make_buckets, push_aliases, push_size
from ray_ppo.train.learner import PPOLearner
from ray_ppo.wire.messages import PushHeader

if TYPE_CHECKING:
    from ray_ppo.cluster.handles import CoordinatorClient


class WeightPublisher:
    """Rank 0 side of a push: gather full state dicts, cut buckets, put each once and hand
    its ref to the coordinator at once (makers stage bucket k while rank 0 puts k+1). Every rank
    must call ``gather`` (it is a collective)."""

    def __init__(self, learner: PPOLearner, coordinator: CoordinatorClient, bucket_mb: float):
        self.learner, self.coordinator, self.bucket_mb = learner, coordinator, bucket_mb
        self.handed: list = []  # the coordinator's acknowledgements of the last push, checked at the next one
        unwrap = learner.strategy.unwrap
        critic = unwrap(learner.critic) if learner.critic is not None else None
        self.trainable = {f"actor.{n}" for n in trainable_names(unwrap(learner.actor))}
        self.trainable |= {f"critic.{n}" for n in trainable_names(critic)} if critic is not None else set()
        self.aliases = push_aliases(unwrap(learner.actor), critic)

    def gather(self) -> dict[str, torch.Tensor]:
        """Collective on every rank: full actor and critic state dicts on rank 0 (``{}`` elsewhere
        when sharded), keys prefixed ``actor.`` / ``critic.`` (no ``critic.`` keys without a
        critic: a critic-free push carries the actor alone)."""
        strategy, critic = self.learner.strategy, self.learner.critic
        return join_state(strategy.full_state_dict(self.learner.actor),
                          strategy.full_state_dict(critic) if critic is not None else {})

    def to_push(self, state: dict[str, torch.Tensor], lora_only: bool) -> dict[str, torch.Tensor]:
        """What a push carries: every tensor once (tied aliases dropped; makers re-tie them), or
        with ``sync.lora_only`` only the adapters and other trainable tensors (value head)."""
        keep = self.trainable if lora_only else set(state) - self.aliases
        return {k: v for k, v in state.items() if k in keep}

    def size(self, state: dict[str, torch.Tensor]) -> int:
        """Bytes a push of ``state`` carries."""
        return push_size(state, self.bucket_mb)[1]

    def publish(self, state: dict[str, torch.Tensor], version: int, kl_coef: float,
                partial: bool = False) -> tuple[float, int]:
        """Put the buckets, each handed on as soon as it is put; returns (seconds, bytes). Rank 0 only.

        The calls are not waited for, and the coordinator (an async actor) may run them out of the
        order they were sent: it keeps a bucket that comes before its push's start
        (``PushRelay``). The next push checks that the previous one's calls succeeded. ``kl_coef`` is the
        trainer's current KL coefficient: the makers shape this version's rewards with it."""
        start = time.perf_counter()
        self.coordinator.wait(self.handed)
        num_chunks, nbytes = push_size(state, self.bucket_mb)
        header = PushHeader(version, num_chunks, nbytes, kl_coef, partial)
        self.handed = [self.coordinator.send("publish_start", header)]
        self.handed += [self.coordinator.send("publish_chunk", version, index, self.coordinator.put(bucket))
                        for index, bucket in enumerate(make_buckets(state, self.bucket_mb))]
        return time.perf_counter() - start, nbytes

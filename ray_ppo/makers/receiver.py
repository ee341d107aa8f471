"""The receiving side of a weight push, shared by ``MakerWorker`` and ``benchmarks/weight_sync.py``.

A push arrives as ``weights_start(header)``, one ``weights_chunk`` per bucket, ``weights_end``
(``ray_ppo.coordinator.actor.Coordinator`` relays them in this order, in the maker's ``model_io``
group), each call carrying the number of its relay. One push can be relayed to a maker twice (the
coordinator resends the latest push to a restarted maker while Ray retries the calls of the relay
its predecessor died in); only the newest relay of a version stages.

``WeightReceiver`` stages the buckets as they arrive (``sync.StagedPush``: the pushed buffers
themselves where the receiving model's dtype and device allow and ``share`` is on, else copies
shaped like the receiving model, into the tensors the previous swap replaced), and hands back a
complete push for the caller's swap; an incomplete or superseded push is dropped and the model
keeps its weights.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ray_ppo.models.sync import StagedPush, replaced_tensors
from ray_ppo.wire.messages import PushHeader


class WeightReceiver:
    """Responsibilities: stage one push at a time, drop an unfinished one when a newer starts,
    and recycle the tensors a swap replaced as the next push's staging memory."""

    def __init__(self, fetch: Callable[[list], dict], share: bool = False):
        """``fetch``: refs -> {ref: bucket, or None where it was lost with its owner}
        (``ray_ppo.cluster.handles.fetch_objects``). ``share``: stage tensors that match their
        target's dtype and device as the pushed buffers themselves (``sync.zero_copy``;
        ``StagedPush``), instead of copies."""
        self.fetch, self.share = fetch, share
        self.staging: StagedPush | None = None
        self.header: PushHeader | None = None  # of the push being staged
        self.relay = 0  # the number of the relay that stages it
        self.spares: dict[str, torch.Tensor] = {}  # the weights the last swap replaced, reused for staging
        self.shared: set[str] = set()  # names whose weights in the model are pushed buffers (never written)

    def start(self, header: PushHeader, targets: Mapping[str, torch.Tensor] | None,
              loaded_version: int | None = None, relay: int = 0) -> bool:
        """chunk_start: begin staging push ``header.version`` (any unfinished earlier push is
        dropped). ``targets``: the receiving models' state dict, keys prefixed ``actor.`` /
        ``critic.`` (``sync.join_state``); None stages views of the buckets (copied at the swap).

        Versions only go up, so the chunk_start of a push older than the one staging or than
        ``loaded_version`` (the weights the model holds) is ignored (returns False):
        the relays of two pushes to one maker are independent calls, and a threaded actor may run
        push 4's chunk_start after push 5's. Were it to replace push 5's staging, the maker would
        stay on push 3 while the trainer waits for experience only a newer policy can make.

        Of two relays of one version (numbered by the coordinator), the newer one stages: an
        older relay's calls come from Ray retrying, on a restarted maker, the calls its dead
        process was sent; the newer relay is the coordinator's resend. The start of the relay
        already staging (a call Ray ran twice) keeps what was staged."""
        if loaded_version is not None and header.version < loaded_version:
            return False
        if self.staging is not None:
            staging = (self.staging.version, self.relay)
            if staging > (header.version, relay):
                return False
            if staging == (header.version, relay):
                return True
        self.header, self.relay = header, relay
        if targets is None:
            self.staging = StagedPush(header.version, header.num_chunks)
            return True
        self.staging = StagedPush(header.version, header.num_chunks, targets, spares=self.spares, share=self.share)
        self.spares = {}  # the staging owns them now; dropped with it if the push never completes
        return True

    def chunk(self, version: int, index: int, bucket_ref: list, relay: int = 0) -> None:
        """One bucket of push ``version``; the ref comes nested so it is fetched here, zero-copy,
        and copied into staged tensors while generation goes on. A bucket lost with its owner
        (trainer rank 0 died after putting it: a ``FailureConfig`` restart) drops the push: the
        model keeps its weights, and the restarted worker group's next push replaces them."""
        if not self._staging(version, relay):
            return
        bucket = self.fetch(bucket_ref)[bucket_ref[0]]
        if bucket is None:  # lost with its owner (OwnerDiedError)
            self.staging = None
            return
        self.staging.add(index, bucket)

    def end(self, version: int, relay: int = 0) -> tuple[PushHeader, StagedPush] | None:
        """chunk_end: the complete push ``version`` (header and staged tensors), or None if it is
        incomplete or was superseded. The end of another push or relay than the one staging
        leaves the staging alone (a late chunk_end must not drop a newer push's buckets)."""
        if not self._staging(version, relay):
            return None
        staged, self.staging = self.staging, None
        if not staged.complete(version):
            return None
        return self.header, staged

    def _staging(self, version: int, relay: int) -> bool:
        """Whether relay ``relay`` of push ``version`` is the one staging."""
        return self.staging is not None and (self.staging.version, self.relay) == (version, relay)

    def recycle(self, staged: StagedPush) -> None:
        """After ``staged`` was swapped in: the tensors it replaced stage the next push, except
        pushed buffers (shared and read-only: never copied into) and names this push shared
        (the next push will share them too: a spare would only hold memory)."""
        replaced = replaced_tensors(staged.targets, staged.tensors)
        self.spares = {name: tensor for name, tensor in replaced.items()
                       if name not in self.shared and name not in staged.shared}
        self.shared = (self.shared - set(staged.tensors)) | staged.shared

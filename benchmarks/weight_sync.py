"""Weight sync: trainer state dict -> buckets -> ray.put -> Coordinator.publish_weights -> makers.

    python benchmarks/weight_sync.py [--repeats 3] [--sizes 100M,1G] [--makers 1,2,4] [--variants serial,pipelined,zero-copy]
                                     [--bucket-mb 256]

Three variants of the push, interleaved in every round:

- ``pipelined`` (what ``WeightPublisher.publish`` and ``MakerWorker`` do): the driver plays rank 0
  (``Coordinator.publish_start``, then ``ray.put`` of each bucket handed on at once with
  ``publish_chunk``); the receivers copy each bucket into staged tensors as it arrives
  (``sync.StagedPush`` with the model's state dict as targets) and swap them in under the lock
  with ``sync.assign_state`` (no copy; tied weights re-tied). This is ``sync.zero_copy=false``.
- ``zero-copy`` (``sync.zero_copy=true``, a CPU maker's default): the same protocol, but the
  receivers stage the pushed buffers themselves (``WeightReceiver(share=True)``): after the swap
  their weights are the object store's buffers, one copy for all receivers.
- ``serial`` (the previous protocol, kept here as the before): every bucket put first, then
  ``Coordinator.publish_weights`` with all refs; receivers stage zero-copy views and
  ``load_state_dict`` (the copy) under the lock.

The real ``Coordinator`` actor relays the refs with ``_push_to`` (weights_start, one
weights_chunk per bucket with the ref nested, weights_end). The receivers are small actors with
the same concurrency groups as ``MakerWorker`` and its receiving code (``ray_ppo.makers.receiver.WeightReceiver``)
and swap, holding a
``GPT2LMHeadModel`` of the pushed shape: a real ``MakerWorker`` builds its models from a Config,
which would add a reference model, critic and tokenizer the sync path does not touch. Models: random weights in GPT-2 shapes from
``GPT2Config`` (no training): ~100 MB = 4 layers x 256 wide, ~1 GB = 16 layers x 1024 wide
(vocab 50257; the tied ``lm_head.weight`` is not pushed, as in the pipeline: ``WeightPublisher.to_push``).

End to end = from the state dict in the trainer to ``Coordinator.wait_for_version`` seeing every
receiver loaded. Per-receiver = bytes / (receiver's weights_start .. weights_end done).
Pause = time inside ``load_state_dict`` under the model lock. Baselines in the same run: a local
``load_state_dict`` of the same state, NumPy ``copyto`` of the same bytes (memcpy), and a naive
push with one RPC per parameter (the tensor passed by value, copied into the model).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import threading
import time

import numpy as np
import ray
import torch

import _common  # noqa: F401
from _common import init_ray, median, publish
from ray_ppo.cluster.handles import fetch_objects
from ray_ppo.config import SyncConfig
from ray_ppo.coordinator.actor import Coordinator
from ray_ppo.makers.receiver import WeightReceiver
from ray_ppo.makers.testing import coordinator_config
from ray_ppo.models.sync import assign_state, bucket_nbytes, fingerprint, make_buckets, push_size, split_state, tied_aliases
from ray_ppo.wire.messages import PushHeader

SHAPES = {"100M": dict(n_layer=4, n_embd=256, n_head=4), "1G": dict(n_layer=16, n_embd=1024, n_head=16),
          "500M": dict(n_layer=8, n_embd=1024, n_head=16)}
BUCKET_MB = SyncConfig().bucket_mb  # the config's default (--bucket-mb)


def build_model(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # pragma: no cover
        import contextlib
        no_init_weights = contextlib.nullcontext
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, **SHAPES[size])
    with no_init_weights():
        model = GPT2LMHeadModel(cfg)
    return model.eval()


@ray.remote(num_cpus=0, concurrency_groups={"compute": 1, "experience_io": 1, "model_io": 1})
class Receiver:
    """The model_io side of MakerWorker, on its receiving code, one model."""

    def __init__(self, size: str):
        torch.set_num_threads(1)
        self.model = build_model(size)
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self.model_lock = threading.Lock()
        self.receiver = WeightReceiver(fetch_objects)
        self.variant = "pipelined"
        self.version = 0
        self.log = {}

    def set_variant(self, variant: str) -> None:
        """How the next pushes are received: ``serial``, ``pipelined`` or ``zero-copy`` (see the
        module docstring). One receiver serves all three, so it knows which weights are shared
        buffers; before a serial push (which copies into the weights) they become own memory again."""
        self.variant = variant
        self.receiver.share = variant == "zero-copy"
        if variant == "serial":
            self._own_weights()

    def _own_weights(self, fill=None) -> None:
        """Give the model weights of its own (copies, or ``fill``'s), never writing into a shared buffer."""
        with self.model_lock:
            assign_state(self.model, {k: fill(v) if fill else v.clone() for k, v in self.model.state_dict().items()})
            self.receiver.shared = set()

    @ray.method(concurrency_group="model_io")
    def weights_start(self, header: PushHeader, relay: int = 0) -> None:
        self.log[header.version] = {"start": time.time()}
        # pipelined, as MakerWorker: staged copies shaped like the model, into the last push's spares;
        # serial: views of the buckets, copied at the swap (the spares stay for the next pipelined push)
        targets = {f"actor.{k}": v for k, v in self.model.state_dict().items()} if self.variant != "serial" else None
        self.receiver.start(header, targets, relay=relay)

    @ray.method(concurrency_group="model_io")
    def weights_chunk(self, version: int, index: int, bucket_ref: list, relay: int = 0) -> None:
        self.receiver.chunk(version, index, bucket_ref, relay)

    @ray.method(concurrency_group="model_io")
    def weights_end(self, version: int, relay: int = 0) -> bool:
        received = self.receiver.end(version, relay)
        if received is None:
            return False
        _, staged = received
        state, _ = split_state(staged.tensors)
        start = time.perf_counter()
        with self.model_lock:
            if staged.targets is not None:
                assign_state(self.model, state)  # as MakerWorker: rebinds to the staged copies, re-ties lm_head
                self.receiver.recycle(staged)  # reused by the next push
            else:
                self.model.load_state_dict(state, strict=False)  # the copy; tied lm_head comes through wte
            self.version = version
        self.log[version].update(pause_s=time.perf_counter() - start, end=time.time())
        return True

    @ray.method(concurrency_group="model_io")
    def set_param(self, name: str, tensor: torch.Tensor) -> None:
        """The naive push: one call per parameter, the tensor passed by value."""
        with self.model_lock, torch.no_grad():
            self.model.get_parameter(name).copy_(tensor)

    def result(self, version: int) -> dict:
        return self.log[version]

    def reset(self) -> None:
        """Zero the weights, so the next push is checked on its own."""
        self._own_weights(torch.zeros_like)

    def fingerprint(self) -> str:
        with self.model_lock:
            return fingerprint(self.model.state_dict())  # lm_head.weight included: it must be re-tied


def push(coordinator, state: dict, version: int, pipelined: bool, bucket_mb: float) -> tuple[float, int, float]:
    """WeightPublisher.publish (or the serial push before it), then wait until every receiver
    loaded it; returns (end to end s, bytes, s until rank 0 is done putting)."""
    start = time.perf_counter()
    if pipelined:
        num_chunks, nbytes = push_size(state, bucket_mb)
        ray.get(coordinator.publish_start.remote(PushHeader(version, num_chunks, nbytes, kl_coef=0.0)))
        ray.get([coordinator.publish_chunk.remote(version, index, [ray.put(bucket)])
                 for index, bucket in enumerate(make_buckets(state, bucket_mb))])
        put_s = time.perf_counter() - start
    else:
        refs, nbytes = [], 0
        for bucket in make_buckets(state, bucket_mb):
            refs.append(ray.put(bucket))
            nbytes += bucket_nbytes(bucket)
        put_s = time.perf_counter() - start
        ray.get(coordinator.publish_weights.remote(PushHeader(version, len(refs), nbytes, kl_coef=0.0), refs))
    versions = ray.get(coordinator.wait_for_version.remote(version, 600.0))
    elapsed = time.perf_counter() - start
    assert all(v >= version for v in versions.values()), versions
    return elapsed, nbytes, put_s


def naive_push(receivers, model) -> float:
    ray.get([r.set_variant.remote("serial") for r in receivers])  # it copies into the weights: own memory first
    start = time.perf_counter()
    for name, p in model.named_parameters():
        ray.get([r.set_param.remote(name, p.detach()) for r in receivers])
    return time.perf_counter() - start


def memcpy_s(nbytes: int, reps: int = 3) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    del src, dst
    return median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="100M,1G")
    ap.add_argument("--makers", default="1,2,4")
    ap.add_argument("--variants", default="serial,pipelined,zero-copy")
    ap.add_argument("--naive-max-makers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="sync.bucket_mb")
    args = ap.parse_args()
    torch.set_num_threads(1)
    makers = [int(x) for x in args.makers.split(",")]
    variants = args.variants.split(",")
    init_ray(num_cpus=8, object_store_gb=4)
    rows = []
    for size in args.sizes.split(","):
        trainer = build_model(size)
        with torch.no_grad():
            for p in trainer.parameters():
                p.normal_(0, 0.02)
        aliases = tied_aliases(trainer)
        state = {f"actor.{k}": v for k, v in trainer.state_dict().items() if k not in aliases}
        plain = {k: v for k, v in trainer.state_dict().items() if k not in aliases}  # the same weights, once
        local = build_model(size)
        receivers = [Receiver.remote(size) for _ in range(max(makers))]
        ray.get([r.__ray_ready__.remote() for r in receivers])
        expected = fingerprint(trainer.state_dict())
        version = 0
        res = collections.defaultdict(list)
        equal: dict = {}
        for rep in range(args.repeats + 1):  # first round is the warm-up
            for n, variant in itertools.product(makers, variants):  # interleaved: every cell once per round
                check = rep == args.repeats  # last round: each receiver starts from zeros and must end exact
                if check:
                    ray.get([r.reset.remote() for r in receivers[:n]])
                coord = ray.remote(num_cpus=0)(Coordinator).remote(
                    coordinator_config(num_makers=n, buffer_size=1, items_per_version=1))
                ray.get(coord.register_makers.remote({i: receivers[i] for i in range(n)}))
                ray.get([r.set_variant.remote(variant) for r in receivers[:n]])
                version += 1
                elapsed, nbytes, put_s = push(coord, state, version, variant != "serial", args.bucket_mb)
                logs = ray.get([r.result.remote(version) for r in receivers[:n]])
                ray.kill(coord)
                if check:
                    equal[(n, variant)] = all(fp == expected for fp in ray.get([r.fingerprint.remote() for r in receivers[:n]]))
                if rep:
                    key = (n, variant)
                    res[(key, "e2e")].append(elapsed)
                    res[(key, "put")].append(put_s)
                    res[(key, "per")].append(median([nbytes / (log["end"] - log["start"]) for log in logs]))
                    res[(key, "pause")].append(max(log["pause_s"] for log in logs))
                    res["nbytes"] = [nbytes]
            for n in makers:
                if n <= args.naive_max_makers and rep:
                    res[(n, "naive")].append(naive_push(receivers[:n], trainer))
            t = time.perf_counter()
            local.load_state_dict(plain, strict=False)
            if rep:
                res["local"].append(time.perf_counter() - t)
                res["memcpy"].append(memcpy_s(res["nbytes"][0], 1))
        nbytes = res["nbytes"][0]
        memcpy_gbs = nbytes / median(res["memcpy"]) / 1e9
        local_s = median(res["local"])
        for n, variant in itertools.product(makers, variants):
            key = (n, variant)
            e2e = median(res[(key, "e2e")])
            naive = median(res[(n, "naive")]) if res[(n, "naive")] else float("nan")
            rows.append([size, f"{nbytes / 1e6:,.0f}", n, variant, nbytes * n / e2e / 1e9, nbytes / e2e / 1e9,
                         median(res[(key, "per")]) / 1e9, memcpy_gbs, nbytes / e2e / 1e9 / memcpy_gbs,
                         1e3 * median(res[(key, "put")]), 1e3 * median(res[(key, "pause")]), 1e3 * local_s,
                         median(res[(key, "pause")]) / local_s,
                         nbytes * n / naive / 1e9 if naive == naive else naive,
                         {True: "yes", False: "NO"}.get(equal.get(key), "not checked")])
        for r in receivers:
            ray.kill(r)
        del trainer, local, state, plain
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    title = f"Weight sync: {args.bucket_mb:g} MiB buckets, median of {args.repeats} interleaved pushes after a warm-up"
    publish("weight_sync", ["model", "MB pushed", "makers", "push", "e2e GB/s (all makers' bytes)", "e2e GB/s (bytes once)",
                 "per-maker GB/s", "memcpy GB/s", "e2e / memcpy", "pack+put ms", "pause ms (max)", "local load_state_dict ms",
                 "pause / local", "naive per-param GB/s", "weights equal"], rows, args=args, title=title)


if __name__ == "__main__":
    main()

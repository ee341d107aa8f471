"""The maker: an ``ExperienceMaker`` in a loop, fed by the coordinator, taking weight pushes.

``MakerWorker`` is a plain class; ``maker_actor_class`` turns it into a threaded Ray actor with
three concurrency groups of one thread each:

  - ``compute``: ``run`` — fetch prompts -> make experience -> hand items to the sender;
  - ``experience_io``: ``send_loop`` — send items to the coordinator (blocks on back-pressure
    while ``run`` goes on generating the next batch);
  - ``model_io``: ``weights_start`` / ``weights_chunk`` / ``weights_end`` — stage a push while
    generation continues; only the final swap takes the model lock.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch

from ray_ppo.config import Config
from ray_ppo.data import PromptEncoder
from ray_ppo.models.quantize import quantize_for_generation
from ray_ppo.sync import StagedPush, fingerprint, join_state, split_state, tied_aliases
from ray_ppo.transport import ExperienceChunk

CONCURRENCY_GROUPS = {"compute": 1, "experience_io": 1, "model_io": 1}
SEND_QUEUE_BATCHES = 2
"""Made batches that may wait for the sender before generation blocks."""


class MakerWorker:
    """Responsibilities: generate experience at the current policy version, keep the
    coordinator fed, and swap in new weights atomically (a push that never completes leaves
    the previous weights in place)."""

    def __init__(self, maker_id: int, config: dict, coordinator: Any):
        from ray_ppo.build import build_experience_maker, maker_device

        self.cfg = Config.from_dict(config)
        torch.set_num_threads(self.cfg.maker.torch_threads)
        torch.manual_seed(self.cfg.seed + 1000 * (maker_id + 1))
        self.maker_id, self.coordinator = maker_id, coordinator
        self.device = maker_device(self.cfg)  # cuda:0 (the GPU Ray gave this actor) if maker.num_gpus > 0
        self.maker = build_experience_maker(self.cfg, name=f"maker_{maker_id}", device=self.device)
        self.maker.actor.eval()
        if self.maker.critic is not None:  # critic-free estimators build none
            self.maker.critic.eval()
        self.float_actor = self.maker.actor  # receives pushes; generation may use a quantized copy
        if self.cfg.maker.quantization:
            if self.maker.ref is None:  # LoRA: the reference stays the float base model
                self.maker.ref = self.float_actor
            self.maker.actor = quantize_for_generation(self.float_actor, self.cfg.maker.quantization)
        self.encoder = PromptEncoder(self.maker.tokenizer, self.cfg.data.max_prompt_len, self.cfg.data.chat_template)
        self.version = 0
        self.model_lock = threading.Lock()
        self.outbox: queue.Queue = queue.Queue(maxsize=SEND_QUEUE_BATCHES)
        self.staging: StagedPush | None = None
        self.made = 0
        self.sent = 0
        self.pause_s = 0.0
        self.pushes_loaded = 0
        if coordinator is not None and ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed:
            # A restarted process: the coordinator counts what died with the old one and resends
            # the latest weights; admission keeps this maker idle until they are loaded.
            ray.get(coordinator.maker_restarted.remote(maker_id))
        self._unreported_idle_s = 0.0

    def ping(self) -> int:
        return os.getpid()

    # -- compute --------------------------------------------------------------------------------
    @ray.method(concurrency_group="compute")
    def run(self) -> dict:
        """Make experience until the coordinator has no more prompts; returns a summary."""
        try:
            if self.cfg.maker.wait_for_weights:
                self._wait_for_first_push()
            while True:
                start = time.perf_counter()
                batch = ray.get(self.coordinator.next_prompts.remote(self.maker_id))
                if batch is None:
                    break
                self._make_and_queue(batch.texts, waited_s=time.perf_counter() - start)
        except Exception as e:  # reported in one line; the full traceback stays in this actor's log
            where = traceback.extract_tb(e.__traceback__)[-1]
            summary = f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"
            ray.get(self.coordinator.maker_failed.remote(self.maker_id, summary))
            raise
        finally:
            self.outbox.put(None)
        return {"made": self.made, "version": self.version}

    def _wait_for_first_push(self, poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + self.cfg.trainer.pull_timeout_s
        while self.pushes_loaded == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"maker_{self.maker_id}: no weight push arrived within "
                                   f"{self.cfg.trainer.pull_timeout_s:.0f} s (maker.wait_for_weights=true)")
            time.sleep(poll_s)

    def _make_and_queue(self, texts: list[str], waited_s: float) -> None:
        """Make one batch and queue it for the sender; ``idle_s`` counts the wait for prompts
        (admission) and for the sender (back-pressure)."""
        encoded = self.encoder.encode(texts)
        stats = {"num_prompts": len(texts), "blank": encoded.blank, "truncated": encoded.truncated}
        if encoded.ids:
            with self.model_lock:
                items, made = self.maker.make_experience(encoded.ids, self.version)
            self.made += len(items)
            stats.update(generate_s=made.generate_s + made.score_s, num_tokens=made.num_tokens)
        else:
            items = []
        start = time.perf_counter()
        stats["idle_s"], self._unreported_idle_s = waited_s + self._unreported_idle_s, 0.0
        self.outbox.put((items, stats))
        self._unreported_idle_s += time.perf_counter() - start  # reported with the next batch

    # -- experience_io --------------------------------------------------------------------------
    @ray.method(concurrency_group="experience_io")
    def send_loop(self) -> dict:
        """Forward made batches to the coordinator, waiting on back-pressure; returns counts.
        A batch travels packed, inside the call or by ref (``topology.transport``,
        ``ray_ppo.transport``)."""
        unsent = 0
        while (entry := self.outbox.get()) is not None:
            items, stats = entry
            chunk = ExperienceChunk.of(items, self.cfg.topology.transport, group_size=self.cfg.maker.samples_per_prompt)
            accepted = ray.get(self.coordinator.send.remote(self.maker_id, chunk, stats))
            self.sent += accepted
            unsent += len(items) - accepted
        return {"sent": self.sent, "unsent": unsent}

    # -- model_io -------------------------------------------------------------------------------
    @ray.method(concurrency_group="model_io")
    def weights_start(self, version: int, num_chunks: int, meta: dict) -> None:
        """chunk_start: begin staging push ``version`` (any unfinished earlier push is dropped)."""
        self.staging = StagedPush(version, num_chunks, meta)

    @ray.method(concurrency_group="model_io")
    def weights_chunk(self, version: int, index: int, bucket_ref: list) -> None:
        """One bucket of push ``version``; the ref comes nested so it is fetched here, zero-copy."""
        if self.staging is None or self.staging.version != version:
            return
        self.staging.add(index, ray.get(bucket_ref[0]))

    @ray.method(concurrency_group="model_io")
    def weights_end(self, version: int) -> bool:
        """chunk_end: swap the staged weights in under the model lock. False if the push is incomplete."""
        staged, self.staging = self.staging, None
        if staged is None or not staged.complete(version):
            return False
        actor_state, critic_state = split_state(staged.tensors)
        partial = bool(staged.meta.get("partial"))  # LoRA-only: adapters and value head
        _check_keys(self.float_actor, actor_state, partial, "actor")  # before touching any weight
        if self.maker.critic is not None:
            _check_keys(self.maker.critic, critic_state, partial, "critic")
        elif critic_state:
            raise ValueError(f"critic push to a critic-free maker (algo.advantage={self.cfg.algo.advantage})")
        start = time.perf_counter()
        with self.model_lock:
            # The staged tensors are CPU views of read-only shared memory; loading copies them
            # into the models' own parameters, on the GPU for a GPU maker.
            self.float_actor.load_state_dict(actor_state, strict=False)  # keys were checked above
            if self.maker.critic is not None:
                self.maker.critic.load_state_dict(critic_state, strict=False)
            if self.cfg.maker.quantization:
                self.maker.actor = quantize_for_generation(self.float_actor, self.cfg.maker.quantization)
            if "kl_coef" in staged.meta:
                self.maker.advantage.kl_coef = staged.meta["kl_coef"]
            self.version = version
            self.pushes_loaded += 1
        self.pause_s += time.perf_counter() - start
        return True

    def weights_fingerprint(self) -> tuple[int, str]:
        """(version, fingerprint of the actor and critic weights) for consistency checks."""
        with self.model_lock:
            critic = self.maker.critic.state_dict() if self.maker.critic is not None else {}
            return self.version, fingerprint(join_state(self.float_actor.state_dict(), critic))


def _check_keys(model: torch.nn.Module, state: dict[str, torch.Tensor], partial: bool, what: str) -> None:
    """A push may never bring tensors the model lacks; it omits tied aliases (loaded through
    their canonical name), and only a partial (LoRA-only) push may omit anything else."""
    expected = set(model.state_dict())
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state) - tied_aliases(model))
    if unknown or (missing and not partial):
        raise ValueError(f"{what} push does not match the maker's model: unknown {unknown[:5]}, missing {missing[:5]}")


def maker_actor_class(num_cpus: float, num_gpus: float, max_restarts: int = 0, resources: dict | None = None):
    """``MakerWorker`` as a Ray actor class with its concurrency groups.

    With ``max_restarts`` a dead maker process is restarted and its interrupted ``run`` and
    ``send_loop`` calls are retried on the new process (``max_task_retries=-1``): both only
    ask the coordinator for more work, so retrying them is safe. Exceptions raised by the code
    are not retried: they end the run.
    """
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, concurrency_groups=CONCURRENCY_GROUPS,
                      max_restarts=max_restarts, max_task_retries=-1 if max_restarts else 0)(MakerWorker)

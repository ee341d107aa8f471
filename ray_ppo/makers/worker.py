"""The maker: an ``ExperienceMaker`` in a loop, fed by the coordinator, taking weight pushes.

``MakerWorker`` is a plain class; ``maker_actor_class`` turns it into a threaded Ray actor with
four concurrency groups of one thread each:

  - ``compute``: ``run`` — fetch prompts -> make experience -> hand items to the sender;
  - ``experience_io``: ``send_loop`` — send items to the coordinator (blocks on back-pressure
    while ``run`` goes on generating the next batch);
  - ``model_io``: ``weights_start`` / ``weights_chunk`` / ``weights_end`` — stage a push while
    generation continues (each bucket is copied into fresh tensors as it arrives); only the
    final swap, which rebinds the parameters to the staged tensors, takes the model lock;
  - ``eval``: ``evaluate`` — answer the ``eval`` section's held-out prompts with the weights of a
    given version, under the model lock (this maker's generation of experience waits meanwhile).

Every process that receives a maker's handle imports this module: Ray loads an actor's class to
read its methods when it deserializes the handle. The coordinator holds the makers' handles and
must not pay for torch (seconds of CPU at each ``fit()`` start on a small machine), so this module
imports torch and the model code only inside the methods that run in the maker.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from ray_ppo.cluster.handles import fetch_objects, find_coordinator, put_object
from ray_ppo.config import Config
from ray_ppo.data import PromptEncoder
from ray_ppo.data.seeds import maker_seed
from ray_ppo.wire.messages import EvalReport, MakerStats, PushHeader, RunHandles
from ray_ppo.wire.transport import ExperienceChunk

if TYPE_CHECKING:
    import torch

    from ray_ppo.makers.episodes import EpisodeStream

CONCURRENCY_GROUPS = {"compute": 1, "experience_io": 1, "model_io": 1, "eval": 1}
SEND_QUEUE_BATCHES = 2
"""Made batches that may wait for the sender before generation blocks."""

logger = logging.getLogger(__name__)


class MakerWorker:
    """Responsibilities: generate experience at the current policy version, keep the
    coordinator fed, and swap in new weights atomically (a push that never completes leaves
    the previous weights in place)."""

    def __init__(self, maker_id: int, config: dict, coordinator: Any, maker_factory: Any = None):
        """``coordinator``: the coordinator's handle, or the ``RunHandles`` to look it up by (what
        ``PPOTrainer`` passes its restartable makers; see ``RunHandles``), or None outside a run.
        ``maker_factory(cfg, name=, device=)`` builds the ``ExperienceMaker`` (default
        ``build.build_experience_maker``); benchmarks pass one that simulates generation."""
        import torch

        from ray_ppo.makers.build import build_experience_maker, maker_device
        from ray_ppo.makers.evaluation import Evaluation
        from ray_ppo.makers.receiver import WeightReceiver
        from ray_ppo.models.quantize import quantize_for_generation

        self.cfg = Config.from_dict(config)
        torch.set_num_threads(self.cfg.maker.torch_threads)
        self.seed = maker_seed(self.cfg.seed, maker_id)  # each maker samples its own stream, reproducibly
        torch.manual_seed(self.seed)
        if isinstance(coordinator, RunHandles):
            coordinator = find_coordinator(coordinator)
        self.maker_id, self.coordinator = maker_id, coordinator
        self.device = maker_device(self.cfg)  # cuda:0 (the GPU Ray gave this maker's process) if maker.num_gpus > 0
        self.maker = (maker_factory or build_experience_maker)(self.cfg, name=f"maker_{maker_id}", device=self.device)
        self.maker.actor.eval()
        if self.maker.critic is not None:  # critic-free estimators build none
            self.maker.critic.eval()
        self.float_policy = self.maker.actor  # the policy model pushes update; generation may use a quantized copy
        if self.cfg.maker.quantization:
            if self.maker.ref is None:  # LoRA: the reference stays the float base model
                self.maker.ref = self.float_policy
            self.maker.actor = quantize_for_generation(self.float_policy, self.cfg.maker.quantization)
        self.engine = self._build_engine() if self.cfg.maker.engine == "vllm" else None
        self.encoder = PromptEncoder(self.maker.tokenizer, self.cfg.data.max_prompt_len, self.cfg.data.chat_template)
        self.version = 0
        self.kl_coef: float | None = None  # the trainer's, with the weights of ``version``; None: ppo.kl_coef
        self.model_lock = threading.Lock()
        # Clear while an evaluation waits for the model lock or holds it: the compute thread waits
        # for it before each batch, since a lock is not fair and back-to-back batches would otherwise
        # keep the evaluation waiting past the push it was meant to evaluate.
        self.no_eval = threading.Event()
        self.no_eval.set()
        self.outbox: queue.Queue = queue.Queue(maxsize=SEND_QUEUE_BATCHES)
        self.batcher = None  # maker.max_running > 0: the ContinuousBatcher, built by run
        self.spanning = 0  # sequences that a weight swap landed in (streaming makers)
        self.answer_lengths: dict[int, float] = {}  # prompt id -> mean answer length (maker.schedule)
        from ray_ppo.makers.dynamic import GroupFilter

        self.group_filter = GroupFilter.of_config(self.cfg)  # algo.dynamic_sampling, else None
        self._answers: dict[int, int] = {}  # prompt id -> answers counted in it
        self.swap_waiting = threading.Event()  # set while a between-batches push waits for the running sequences
        self.receiver = WeightReceiver(share=self.cfg.sync.zero_copy, fetch=fetch_objects)
        self.items_made = 0  # items made since this process started (the summary's ``made``)
        self.sent = 0
        self.pause_s = 0.0
        self._unreported_pause_s = 0.0
        self.pushes_loaded = 0
        # Read now, not at the first evaluation: the base model's must start before a push lands.
        self.evaluation = Evaluation.of_config(self.cfg, self.maker.tokenizer) if self.cfg.eval.path else None
        if coordinator is not None and ray.is_initialized() and _was_restarted():
            # A restarted process: the coordinator counts what died with the old one and resends
            # the latest weights; admission keeps this maker idle until they are loaded.
            ray.get(coordinator.maker_restarted.remote(maker_id))
        self._unreported_idle_s = 0.0

    def ping(self) -> int:
        return os.getpid()

    def _build_engine(self):
        """maker.engine=vllm: a vLLM engine in this process generates; the HF models score."""
        from ray_ppo.makers.vllm_engine import build_engine

        engine = build_engine(self.cfg, self.cfg.model.pretrained, self.seed,
                              on_gpu=self.device.type == "cuda")
        self.maker.engine, self.maker.engine_logprobs = engine, self.cfg.maker.sampler_logprobs
        return engine

    # -- compute --------------------------------------------------------------------------------
    @ray.method(concurrency_group="compute")
    def run(self) -> dict:
        """Make experience until the coordinator has no more prompts; returns a summary. The next
        prompt batch is asked for as soon as one arrives, so its round trip to the coordinator
        (and any wait at admission it can absorb) passes while this one is made. A made batch goes
        to the sender once the next one is encoded (when its prompts are already here), so the
        sender packs it while the next batch generates: this thread and the sender's would
        otherwise take turns on the GIL between two batches, when generation waits for both."""
        made_batch = None  # (items, stats) of the last batch, until the sender has it
        try:
            if self.cfg.maker.wait_for_weights:
                self._wait_for_first_push()
            if self.cfg.maker.max_running:
                self._stream()
                return {"made": self.items_made, "version": self.version, "spanning_swaps": self.spanning,
                        "slot_utilisation": self.batcher.utilisation}
            asked = self.coordinator.next_prompts.remote(self.maker_id)
            while True:
                if made_batch is not None and not ray.wait([asked], timeout=0)[0]:
                    # Admission may be waiting for these very items (the staleness bound): send first.
                    self._queue(made_batch)
                    made_batch = None
                start = time.perf_counter()
                batch = ray.get(asked)
                waited_s = time.perf_counter() - start
                if batch is not None:
                    asked = self.coordinator.next_prompts.remote(self.maker_id)
                    encoded = self.encoder.encode(batch.prompts)
                if made_batch is not None:
                    self._queue(made_batch)
                    made_batch = None
                if batch is None:
                    break
                made_batch = self._make(batch.prompts, batch.ids, encoded, waited_s)
        except Exception as e:
            self._report_failure(e)
            raise
        finally:
            if made_batch is not None:
                self._queue(made_batch)
            self.outbox.put(None)
        return {"made": self.items_made, "version": self.version}

    def _report_failure(self, e: Exception) -> None:
        """Tell the coordinator this maker failed with ``e``: in one line, with the full traceback
        for RUN_DIR/error.log (the coordinator's next pull ends the run with it)."""
        where = traceback.extract_tb(e.__traceback__)[-1]
        summary = f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"
        ray.get(self.coordinator.maker_failed.remote(self.maker_id, summary, "".join(traceback.format_exception(e))))

    def _stream(self) -> None:
        """``maker.max_running`` > 0: continuous batching. Prompt batches are taken from the
        coordinator while the batcher has fewer waiting sequences than slots (never blocking while
        sequences run), each prompt's ``samples_per_prompt`` sequences are queued, the batcher steps
        under the model lock (so a push swaps in between two steps: ``weights_end``), and the
        groups that finished at a step are made into experience and sent at once. A batch's blank
        prompts are reported with the next send (their ids carry no items)."""
        from ray_ppo.makers.episodes import EpisodeStream
        from ray_ppo.models.continuous import ContinuousBatcher, Request

        m = self.cfg.maker
        # A maker may bring its own batcher class (benchmarks simulate one: ray_ppo.makers.testing);
        # a vLLM engine streams through its own (VllmEngine.continuous_batcher, same interface).
        batcher_class = getattr(self.maker, "batcher_class", ContinuousBatcher)
        if self.engine is not None:
            batcher_class = self.engine.continuous_batcher
        self.batcher = batcher = batcher_class(
            self.maker.actor, m, self.maker.tokenizer.pad_token_id, self.maker.stop_ids, max_running=m.max_running,
            kv_at_swap=m.kv_at_swap, version=self.version, schedule=m.schedule)
        groups: dict[tuple, list] = {}  # (batch number, prompt index) -> its finished sequences (or episodes)
        runner = self.maker.episodes  # with env.cls or agent.fn: turns stream, steps (or agents) beside
        if self.cfg.agent.fn and self.cfg.agent.host is None:  # the endpoint binds to this node's address
            runner.host = ray.util.get_node_ip_address()
        episodes = EpisodeStream(None, m.max_new_tokens) if runner is None else runner.stream(m.max_new_tokens)
        unreported = _Unreported()
        asked, number = self.coordinator.next_prompts.remote(self.maker_id), 0
        while asked is not None or batcher.busy or episodes.stepping:
            if asked is not None and len(batcher.waiting) < m.max_running:
                start = time.perf_counter()
                ready, _ = ray.wait([asked], timeout=0 if batcher.busy or episodes.stepping else None)
                unreported.admission_s += time.perf_counter() - start
                if ready:
                    batch = ray.get(asked)
                    asked = None if batch is None else self.coordinator.next_prompts.remote(self.maker_id)
                    if batch is not None:
                        number += 1
                        self._open(batch, number, batcher, groups, unreported, Request, episodes)
            whole: list[list] = []
            # Episodes whose environment answered: the next turn queues, or the episode is done.
            for episode in episodes.answered(batcher, wait=not batcher.busy):
                self._finished(episode, groups, whole)
            if unreported.ready_to_send(batcher.busy or bool(episodes.stepping)):
                for made in unreported.send(None, self):
                    self._queue(made)
            if batcher.busy:
                self.no_eval.wait()
                with self.model_lock:
                    start = time.perf_counter()
                    done = batcher.step(admit=not self.swap_waiting.is_set())
                    unreported.generate_s += time.perf_counter() - start
                self.spanning += sum(1 for f in done if f.swaps)
                for f in done:
                    if m.schedule == "longest_first":  # fifo reads no estimate: keep none
                        self._learn_length(f.key[3], len(f.tokens))
                    if episodes.runner is not None:  # a turn: the environment's step starts
                        episodes.turn(f)
                    else:
                        self._finished(f, groups, whole)
            if whole:
                for made in unreported.send(whole, self):
                    self._queue(made)

    def _finished(self, done, groups: dict, whole: list) -> None:
        """A finished sequence (or episode) joins its group; a whole group goes to ``whole``."""
        group = groups[done.key[:2]]
        group.append(done)
        if len(group) == self.cfg.maker.samples_per_prompt:
            whole.append(groups.pop(done.key[:2]))

    def _open(self, batch, number: int, batcher, groups: dict, unreported: _Unreported, request,
              episodes: EpisodeStream) -> None:
        """Queue a prompt batch's sequences (or episodes' first turns) in the batcher; its blank
        prompts wait for the next send."""
        encoded = self.encoder.encode(batch.prompts)
        kept = set(encoded.kept)
        unreported.blank_ids += [pid for i, pid in enumerate(batch.ids) if i not in kept]
        unreported.blank += encoded.blank
        unreported.truncated += encoded.truncated
        for k, (index, ids) in enumerate(zip(encoded.kept, encoded.ids, strict=True)):
            groups[(number, k)] = []
            prompt_id = batch.ids[index] if batch.ids else None
            expected = self.answer_lengths.get(prompt_id)
            keys = [(number, k, s, prompt_id, encoded.prompts[k]) for s in range(self.cfg.maker.samples_per_prompt)]
            if episodes.runner is not None:
                episodes.start(batcher, keys, ids, expected)
            else:
                batcher.submit(request(key, ids, expected_len=expected) for key in keys)

    def _learn_length(self, prompt_id: int | None, length: int) -> None:
        """Keep a running estimate of ``prompt_id``'s answer length (``maker.schedule=longest_first``):
        the mean of its answers so far, each sample counted."""
        if prompt_id is None:
            return
        mean, n = self.answer_lengths.get(prompt_id, 0.0), self._answers.get(prompt_id, 0)
        self.answer_lengths[prompt_id] = (mean * n + length) / (n + 1)
        self._answers[prompt_id] = n + 1

    def _wait_for_first_push(self) -> None:
        self._wait_for_push(lambda: self.pushes_loaded > 0, f"maker_{self.maker_id}: no weight push arrived within "
                            f"{self.cfg.trainer.pull_timeout_s:.0f} s (maker.wait_for_weights=true)")

    def _wait_for_push(self, loaded, problem: str, poll_s: float = 0.05) -> None:
        """Poll until ``loaded()`` (a weight push has swapped in); after ``trainer.pull_timeout_s``
        raise ``TimeoutError(problem)``."""
        deadline = time.monotonic() + self.cfg.trainer.pull_timeout_s
        while not loaded():
            if time.monotonic() > deadline:
                raise TimeoutError(problem)
            time.sleep(poll_s)

    def _make(self, prompts: list, prompt_ids: list[int], encoded, waited_s: float) -> tuple[list, MakerStats]:
        """Make one batch of ``encoded`` prompts; returns its items (each carrying its prompt and its id)
        and stats, which cover every id of the batch (the coordinator counts the ones without
        items as blank) and the waits since the previous batch: for prompts (admission) and for
        the sender (back-pressure, counted by ``_queue``)."""
        items, generation, dropped = [], {}, []
        if encoded.ids:
            self.no_eval.wait()
            with self.model_lock:
                items, run = self.maker.make_experience(encoded.ids, self.version, self.kl_coef, encoded.prompts)
            _warn_faults(self.maker_id, run.faults)
            if prompt_ids:
                tag_prompt_ids(items, [prompt_ids[i] for i in encoded.kept])
            if self.group_filter is not None:
                items, dropped = self.group_filter(items)
            self.items_made += len(items)
            generation = dict(generate_s=run.generate_s + run.score_s, num_tokens=run.num_tokens,
                              logprob_gap=run.logprob_gap)
        idle_s, self._unreported_idle_s = waited_s + self._unreported_idle_s, 0.0
        pause_s, self._unreported_pause_s = self._unreported_pause_s, 0.0
        stats = MakerStats(num_prompts=len(prompts), prompt_ids=tuple(prompt_ids), blank=encoded.blank,
                           dropped_ids=tuple(dropped), truncated=encoded.truncated, idle_s=idle_s, pause_s=pause_s,
                           admission_s=waited_s, **generation)  # admission_s: of idle_s, the wait for this batch
        return items, stats

    def _queue(self, made_batch: tuple[list, MakerStats]) -> None:
        """Hand a made batch to the sender; a wait for room (back-pressure) is reported with the next batch."""
        start = time.perf_counter()
        self.outbox.put(made_batch)
        self._unreported_idle_s += time.perf_counter() - start

    # -- experience_io --------------------------------------------------------------------------
    @ray.method(concurrency_group="experience_io")
    def send_loop(self) -> dict:
        """Forward made batches to the coordinator, waiting on back-pressure; returns counts.
        A batch travels packed, inside the call or by ref (``topology.transport``,
        ``ray_ppo.wire.transport``)."""
        unsent = 0
        try:
            while (entry := self.outbox.get()) is not None:
                items, stats = entry
                chunk = ExperienceChunk.of(items, self.cfg.topology.transport,
                                           group_size=self.cfg.maker.samples_per_prompt, put=put_object)
                accepted = ray.get(self.coordinator.send.remote(self.maker_id, chunk, stats))
                self.sent += accepted
                unsent += len(items) - accepted
        except Exception as e:  # else generation would block on a full outbox and the run wait for nothing
            self._report_failure(e)
            raise
        return {"sent": self.sent, "unsent": unsent}

    # -- model_io -------------------------------------------------------------------------------
    @ray.method(concurrency_group="model_io")
    def weights_start(self, header: PushHeader, relay: int = 0) -> None:
        """chunk_start: begin staging push ``header.version`` for the coordinator's relay number
        ``relay`` (any unfinished earlier push is dropped; one older than the push staging or the
        weights held, or an older relay of the push staging, is ignored: ``WeightReceiver.start``)."""
        from ray_ppo.models.sync import join_state

        if not self.receiver.start(header, join_state(self.float_policy.state_dict(), self._critic_state()),
                                   loaded_version=self.version, relay=relay):
            staging = self.receiver.staging.version if self.receiver.staging is not None else None
            logger.warning("maker_%d: chunk_start of push v%d (relay %d) came after newer weights or a newer relay "
                           "(holding v%d, staging v%s, relay %d); ignored, the newer one stands", self.maker_id,
                           header.version, relay, self.version, staging, self.receiver.relay)

    @ray.method(concurrency_group="model_io")
    def weights_chunk(self, version: int, index: int, bucket_ref: list, relay: int = 0) -> None:
        """One bucket of push ``version``; the ref comes nested so it is fetched here, zero-copy,
        and copied into staged tensors on the maker's device while generation goes on."""
        self.receiver.chunk(version, index, bucket_ref, relay)

    @ray.method(concurrency_group="model_io")
    def weights_end(self, version: int, relay: int = 0) -> bool:
        """chunk_end: swap the staged weights in under the model lock. False if the push is
        incomplete, or another relay or push is staging."""
        from ray_ppo.makers.vllm_engine import hf_weights
        from ray_ppo.models.quantize import quantize_for_generation
        from ray_ppo.models.sync import prepare_swap, split_state

        received = self.receiver.end(version, relay)
        if received is None:
            return False
        header, staged = received
        policy_state, critic_state = split_state(staged.tensors)
        partial = header.partial  # LoRA-only: adapters and value head
        _check_keys(self.float_policy, policy_state, partial, "actor")  # before touching any weight
        if self.maker.critic is not None:
            _check_keys(self.maker.critic, critic_state, partial, "critic")
        elif critic_state:
            raise ValueError(f"critic push to a critic-free maker (algo.advantage={self.cfg.algo.advantage})")
        # The staged tensors are the maker's own copies, already on its device and in its dtype
        # (or shared read-only with the object store): the swap rebinds parameters (and re-ties
        # tied ones), it copies nothing. What it binds where is worked out while generation goes on.
        swaps = [prepare_swap(self.float_policy, policy_state)]
        if self.maker.critic is not None:
            swaps.append(prepare_swap(self.maker.critic, critic_state))
        if self.batcher is not None and self.cfg.maker.weight_updates == "between_batches":
            self._wait_until_no_sequence_runs()
        with self.model_lock:  # generation is paused from here (a batch, or a decode step, being made finishes first)
            start = time.perf_counter()
            for swap in swaps:
                swap.apply()
            if self.cfg.maker.quantization:  # a fresh int8 copy of the new float weights generates from here
                self.maker.actor = quantize_for_generation(self.float_policy, self.cfg.maker.quantization)
            if self.batcher is not None:  # in flight: the running sequences go on under the new weights
                generator = self.maker.actor  # the float policy (swapped in place above) or its new int8 copy
                self.batcher.swap(lambda: setattr(self.batcher, "model", generator), version)
                self.swap_waiting.clear()
            if self.engine is not None:  # after the HF copy swapped in the push, load it into the engine
                self.engine.load(hf_weights(self.float_policy).items(), version)
            self.version, self.kl_coef = version, header.kl_coef
            self.pushes_loaded += 1
            paused = time.perf_counter() - start
        if self.device.type == "cpu":  # on a GPU the caching allocator reuses the memory anyway
            self.receiver.recycle(staged)
        self.pause_s += paused
        self._unreported_pause_s += paused
        return True

    def _wait_until_no_sequence_runs(self, poll_s: float = 0.01) -> None:
        """maker.weight_updates=between_batches: stop admitting sequences and wait until the running
        ones have finished (the swap then comes between them and the next)."""
        self.swap_waiting.set()
        while self.batcher.rows:
            time.sleep(poll_s)

    # -- eval -----------------------------------------------------------------------------------
    @ray.method(concurrency_group="eval")
    def evaluate(self, step: int, version: int) -> EvalReport:
        """The ``eval`` section's evaluation of the weights of ``step``, push ``version`` (0: the
        base model), once this maker holds them (a later push that came first answers instead: the
        report names the version that did). The model lock is held throughout, so one version
        answers every prompt; meanwhile this maker's experience waits, the other makers' does not."""
        self._wait_for_push(lambda: self.version >= version, f"maker_{self.maker_id} was asked to evaluate push "
                            f"v{version} (step {step}) while holding v{self.version}, and v{version} had not arrived "
                            f"after {self.cfg.trainer.pull_timeout_s:.0f} s")
        self.no_eval.clear()
        try:
            with self.model_lock:
                start = time.perf_counter()
                result = self.evaluation.run(self.maker.actor, self.engine, model=f"maker_{self.maker_id}")
                held = self.version
        finally:
            self.no_eval.set()
        return result.report(step, held, self.maker_id, eval_s=time.perf_counter() - start)

    def weights_fingerprint(self) -> tuple[int, str]:
        """(version, fingerprint of the policy and critic weights) for consistency checks. With an
        engine, the policy's weights are those read back from the engine, not the HF copy's."""
        from ray_ppo.makers.vllm_engine import engine_actor_state
        from ray_ppo.models.sync import fingerprint, join_state

        with self.model_lock:
            policy_state = (self.float_policy.state_dict() if self.engine is None
                            else engine_actor_state(self.engine, self.float_policy))
            return self.version, fingerprint(join_state(policy_state, self._critic_state()))

    def _critic_state(self) -> dict[str, torch.Tensor]:
        """The critic's state dict; empty for critic-free estimators (``algo.advantage`` != gae)."""
        return self.maker.critic.state_dict() if self.maker.critic is not None else {}


class _Unreported:
    """What a streaming maker has not yet reported to the coordinator: blank prompts, the time
    generating and waiting, and its batcher's slot and cache counts since its last send."""

    def __init__(self, counted: tuple[int, int, int, int] = (0, 0, 0, 0)):
        self.blank_ids: list[int] = []
        self.blank = self.truncated = 0
        self.generate_s = self.admission_s = 0.0
        self.counted = counted  # the batcher's (slot capacity, slot steps, kv kept, kv recomputed) at the last send

    def ready_to_send(self, busy: bool) -> bool:
        """Blank prompts go at once when no sequence runs (none would carry them soon)."""
        return bool(self.blank_ids or self.blank) and not busy

    def send(self, groups: list[list] | None, worker: MakerWorker) -> list[tuple[list, MakerStats]]:
        """The items of the finished ``groups`` (each ``samples_per_prompt`` sequences) with the stats
        of the send, which carry every unreported blank prompt; then nothing is unreported. A
        chunk holds one policy version, so groups of different versions (their oldest sequence's)
        go as one send each, the blank prompts and the times with the first."""
        items, made, dropped = [], None, []  # dropped: algo.dynamic_sampling's groups of this send
        if groups:
            finished = [f for group in groups for f in sorted(group, key=lambda f: f.key[2])]
            items, made = worker.maker.experience_of(finished, worker.kl_coef, [f.key[4] for f in finished])
            _warn_faults(worker.maker_id, made.faults)
            for item, f in zip(items, finished, strict=True):
                if f.key[3] is not None:
                    item.prompt_id = int(f.key[3])
            if worker.group_filter is not None:
                items, dropped = worker.group_filter(items)
            worker.items_made += len(items)
        by_version: dict[int, list] = {}
        for item in items:
            by_version.setdefault(item.policy_version, []).append(item)
        batcher = worker.batcher
        counted = (batcher.steps * batcher.max_running, batcher.slot_steps, batcher.kv_kept, batcher.kv_recomputed)
        capacity, slot_steps, kv_kept, kv_recomputed = (now - before for now, before in zip(counted, self.counted))
        pause_s, worker._unreported_pause_s = worker._unreported_pause_s, 0.0
        idle_s, worker._unreported_idle_s = self.admission_s + worker._unreported_idle_s, 0.0
        sends = []
        for part in list(by_version.values()) or [[]]:
            group_ids = [it.prompt_id for it in part[::worker.cfg.maker.samples_per_prompt] if it.prompt_id >= 0]
            first = not sends
            extra = self.blank_ids + dropped if first else []  # ids that carry no item, with the first
            stats = MakerStats(
                num_prompts=len(part) // worker.cfg.maker.samples_per_prompt + (self.blank + len(dropped)
                                                                                 if first else 0),
                prompt_ids=tuple(group_ids + extra), blank=self.blank if first else 0,
                dropped_ids=tuple(dropped) if first else (),
                truncated=self.truncated if first else 0, num_tokens=sum(it.num_actions for it in part),
                **(dict(idle_s=idle_s, pause_s=pause_s, admission_s=self.admission_s,
                        generate_s=self.generate_s + (made.score_s if made else 0.0), running=len(batcher.rows),
                        slot_steps=slot_steps, slot_capacity=capacity, kv_kept=kv_kept, kv_recomputed=kv_recomputed)
                   if first else dict(running=len(batcher.rows))))
            sends.append((part, stats))
        self.__init__(counted)
        return sends


def _warn_faults(maker_id: int, faults: list[str]) -> None:
    """One warning per episode that ended on an environment fault: the episode ended, the run goes on."""
    for fault in faults:
        logger.warning("maker_%d: an episode ended on an environment fault: %s", maker_id, fault)


def tag_prompt_ids(items: list, prompt_ids: list[int]) -> None:
    """Give each item the id of its prompt. Items come prompt-major: with k samples per prompt,
    items ``i*k .. i*k+k-1`` answer prompt ``i``."""
    if not prompt_ids or len(items) % len(prompt_ids):
        raise ValueError(f"{len(items)} items for {len(prompt_ids)} prompts: expected a whole number of samples per prompt")
    per_prompt = len(items) // len(prompt_ids)
    for i, item in enumerate(items):
        item.prompt_id = int(prompt_ids[i // per_prompt])


def _was_restarted() -> bool:
    """Whether this actor process is a restart. Ray's own property reads its deprecated ``actor_id``
    inside, which would print a RayDeprecationWarning in every maker; the property itself is current."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _check_keys(model: torch.nn.Module, state: dict[str, torch.Tensor], partial: bool, what: str) -> None:
    """A push may never bring tensors the model lacks; it omits tied aliases (loaded through
    their canonical name), and only a partial (LoRA-only) push may omit anything else."""
    from ray_ppo.models.sync import tied_aliases

    expected = set(model.state_dict())
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state) - tied_aliases(model))
    if unknown or (missing and not partial):
        raise ValueError(f"{what} push does not match the maker's model: unknown {unknown[:5]}, missing {missing[:5]}")


def maker_actor_class(num_cpus: float, num_gpus: float, max_restarts: int = 0, resources: dict | None = None):
    """``MakerWorker`` as a Ray actor class with its concurrency groups.

    With ``max_restarts`` a dead maker process is restarted and its interrupted calls are retried
    on the new process (``max_task_retries=-1``). ``run`` and ``send_loop`` only ask the
    coordinator for more work, so retrying them is safe. The weight-push calls of a relay the
    dead process was in are retried too, beside the coordinator's resend of the latest push:
    each carries its relay's number, and the newer relay stages (``WeightReceiver.start``).
    Exceptions raised by the code are not retried: they end the run.
    """
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, concurrency_groups=CONCURRENCY_GROUPS,
                      max_restarts=max_restarts, max_task_retries=-1 if max_restarts else 0)(MakerWorker)

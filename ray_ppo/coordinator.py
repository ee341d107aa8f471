"""The coordinator: one named actor per run that relays experience and weights.

Responsibilities:
  - hand out prompt batches to makers from the run's prompt dataset (so a dead maker never
    stalls the others, unlike ``streaming_split``'s per-epoch barrier);
  - admit makers only while their policy version is within ``max_staleness`` of the trainer's;
  - route experience chunks (packed item batches, inline or by ref: ``ray_ppo.transport``) into
    bounded per-rank buffers, by count and version only (back-pressure: a send waits for space);
  - drop, and count, items that became too stale while buffered;
  - relay weight pushes to makers as ObjectRefs (never tensors) and track each maker's version;
  - keep the run's counters, per-step metrics and maker failures;
  - follow every prompt by identity until it is trained (``ray_ppo.ledger``): prompts whose
    items are discarded or lost are served again, so each is trained on exactly once.

``Coordinator`` is a plain class whose methods are coroutines; ``ray.remote`` turns it into an
async actor where it is created. All its methods run on one event loop (one concurrency group),
so its state needs no locks.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ray_ppo.ledger import PromptLedger
from ray_ppo.routing import receivers
from ray_ppo.transport import ExperienceChunk

HEALTH_CHECK_S = 5.0
"""How long a maker has to answer a ping when the coordinator diagnoses a stall."""


@dataclass
class Counters:
    """Item accounting. At any time: produced = consumed + in_flight + discarded + lost_in_transit."""

    produced: int = 0          # items makers handed to ``send``
    consumed: int = 0          # items returned to trainer ranks by ``pull``
    discarded: int = 0         # items dropped because they exceeded ``max_staleness``
    lost: int = 0              # prompts handed to a maker that died before sending their items
    lost_in_transit: int = 0   # items sent by a maker that died before a rank fetched them
    in_flight: int = 0         # items buffered or waiting for buffer space
    prompts_served: int = 0    # prompts handed to makers
    blank_prompts: int = 0     # prompts skipped because they were empty
    truncated_prompts: int = 0 # prompts cut to ``data.max_prompt_len`` tokens
    epochs: int = 0            # full passes over the prompt dataset started
    prompts_trained: int = 0   # prompts all of whose items were pulled for a step (each counted once)
    prompts_requeued: int = 0  # prompts served again: items discarded, lost, or trained in redone steps

    def with_prompts(self, ledger: PromptLedger) -> dict:
        """These counters with the ledger's prompt counts filled in."""
        return {**asdict(self), "prompts_trained": ledger.counts["trained"], "prompts_requeued": ledger.counts["requeued"]}


@dataclass
class PromptBatch:
    """Work item for a maker: raw prompt texts (encoding happens in the maker)."""

    texts: list[str]
    epoch: int
    ids: list[int] = field(default_factory=list)
    """Prompt id of each text (``ray_ppo.ledger``); the maker tags the items it makes with them."""


@dataclass
class MakerState:
    version: int = 0
    failed: str | None = None
    generate_s: float = 0.0
    idle_s: float = 0.0
    admission_s: float = 0.0  # of idle_s: waiting for prompts (admission control); the rest is back-pressure
    pause_s: float = 0.0      # generation paused for weight swaps
    tokens: int = 0
    reserved: int = 0   # prompts handed out whose items have not come back
    restarts: int = 0


@dataclass
class Push:
    """A weight push: the refs of its buckets as rank 0 hands them in (index -> ref), relayed to
    makers as they arrive; ``arrived`` wakes the relays."""

    version: int
    num_chunks: int
    nbytes: int
    meta: dict
    bucket_refs: dict[int, Any] = field(default_factory=dict)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    started: float = field(default_factory=time.perf_counter)


class Coordinator:
    def __init__(self, num_ranks: int, num_makers: int, buffer_size: int, max_staleness: int,
                 items_per_version: int, routing: str = "round_robin", prompts: Any = None,
                 prompt_batch_size: int = 16, shuffle: bool = True, seed: int = 0,
                 initial_version: int = 0, data_start: dict | None = None, samples_per_prompt: int = 1):
        self.num_ranks, self.num_makers = num_ranks, num_makers
        self.buffer_size, self.max_staleness, self.routing = buffer_size, max_staleness, routing
        self.buffers: list[collections.deque[ExperienceChunk]] = [collections.deque() for _ in range(num_ranks)]
        self.changed = asyncio.Condition()
        self.counters = Counters()
        self.makers: dict[int, Any] = {}
        self.maker_state = {i: MakerState() for i in range(num_makers)}
        self.trainer_version = initial_version  # > 0 when resuming: makers wait for the restored weights
        self.items_per_version = items_per_version
        self.consumed_at_version = 0  # items pulled since the trainer reached its current version
        self.reserved = 0  # prompts handed out whose items have not come back yet
        self.prompt_batch_size = prompt_batch_size
        self.samples_per_prompt = samples_per_prompt  # items a prompt turns into (one group)
        self.latest_push: Push | None = None  # its refs stay alive for makers that (re)join late
        self.push_log: list[tuple[int, int]] = []  # (version, bytes) of every push
        self.push_tasks: set[asyncio.Task] = set()
        self.metrics: list[dict] = []
        self.checkpoints: list[tuple[int, Any]] = []  # (step, ray.train.Checkpoint) as Ray Train stored them
        self.logprob_gaps: list[tuple[float, float, int]] = []  # per engine batch: (sum, max, tokens) of |vLLM - HF|
        self.rank_pids: dict[int, int | None] = {}  # process of each trainer rank, for diagnostics
        self.finished = False
        self.last_item_at = time.monotonic()
        self._rr = 0
        self.ledger = PromptLedger(shuffle, seed, data_start)
        self._prompts = PromptFeed(prompts, self.ledger) if prompts is not None else None

    # -- set-up ---------------------------------------------------------------------------------
    def register_makers(self, handles: dict[int, Any]) -> None:
        self.makers = dict(handles)

    def ready(self) -> bool:
        return True

    # -- prompts --------------------------------------------------------------------------------
    async def next_prompts(self, maker_id: int) -> PromptBatch | None:
        """Next prompt batch for ``maker_id``; waits while the maker is too stale; None once the run
        is over, or once the maker was restarted while this call waited (its caller died with the
        old process, and a batch handed to it would be lost without being counted)."""
        state = self.maker_state[maker_id]
        restarts = state.restarts
        async with self.changed:
            await self.changed.wait_for(lambda: self.finished or state.restarts != restarts or self._admitted(maker_id))
            if self.finished or state.restarts != restarts:
                return None
            self._reserve(maker_id, self.prompt_batch_size)  # before any await, so admission sees it
        batch = await self._prompts.next(maker_id, self.prompt_batch_size)
        self.counters.prompts_served += len(batch.texts)
        self.counters.epochs = self._prompts.epoch + 1
        if state.restarts != restarts:  # maker_restarted counted the reservation as lost: make it the batch
            self.counters.lost += len(batch.texts) - self.prompt_batch_size
            self.ledger.give_back(maker_id, batch.ids)
            return None
        self._reserve(maker_id, len(batch.texts) - self.prompt_batch_size)
        return batch

    def _reserve(self, maker_id: int, n: int) -> None:
        self.reserved += n
        self.maker_state[maker_id].reserved += n

    def _admitted(self, maker_id: int) -> bool:
        """Admission control: hand out a batch only if its items can still be trained on within
        ``max_staleness`` versions, counting everything already buffered or being generated.

        Items made at maker version v are usable while the trainer's version is <= v + S; until
        then the trainer consumes at most ``(v + S - V + 1) * items_per_version`` items, minus what
        it already consumed at its current version V. A prompt reserved or handed out becomes
        ``samples_per_prompt`` items.
        """
        v, V, S = self.maker_state[maker_id].version, self.trainer_version, self.max_staleness
        capacity = (v + S - V + 1) * self.items_per_version - self.consumed_at_version
        pending = (self.reserved + self.prompt_batch_size) * self.samples_per_prompt
        return self.counters.in_flight + pending <= capacity

    # -- experience -----------------------------------------------------------------------------
    async def send(self, maker_id: int, chunk: ExperienceChunk, stats: dict) -> int:
        """Buffer the chunk's items for the trainer ranks, waiting for space. Returns how many
        were accepted (all, unless the run finished while waiting: the rest are counted in flight)."""
        self.counters.produced += chunk.count
        self.counters.in_flight += chunk.count
        self._reserve(maker_id, -stats.get("num_prompts", 0))
        self._record_maker_stats(maker_id, stats)
        self.ledger.returned(maker_id, stats.get("prompt_ids", ()), chunk.item_prompt_ids())
        targets = receivers(self.routing, maker_id, self.num_makers, self.num_ranks)
        rest = chunk
        async with self.changed:
            while rest.count:
                await self.changed.wait_for(lambda: self.finished or self._has_space(targets))
                if self.finished:
                    break
                rest = self._route(rest, targets)
                self.changed.notify_all()  # once per pass, not per item
        self.last_item_at = time.monotonic()
        return chunk.count - rest.count

    def _route(self, chunk: ExperienceChunk, targets: list[int]) -> ExperienceChunk:
        """Place as many of the chunk's groups as fit, each on the target rank with the most free
        space (ties round-robin), as one slice per rank; returns the slice that did not fit. A
        group (``chunk.group_size`` items, the responses to one prompt) is never split: buffer
        sizes and batch sizes are multiples of it (``config._check_groups``)."""
        load = {r: self._buffered(r) for r in targets}
        shares = dict.fromkeys(targets, 0)
        g = chunk.group_size
        for _ in range(chunk.count // g):
            if all(load[r] >= self.buffer_size for r in targets):
                break
            rank = self._pick(targets, load)
            load[rank] += g
            shares[rank] += g
        for rank, n in shares.items():
            if n:
                head, chunk = chunk.split(n)
                self.buffers[rank].append(head)
        return chunk

    def _buffered(self, rank: int) -> int:
        """Items in ``rank``'s buffer."""
        return sum(chunk.count for chunk in self.buffers[rank])

    def _has_space(self, targets: list[int]) -> bool:
        return any(self._buffered(r) < self.buffer_size for r in targets)

    def _pick(self, targets: list[int], load: dict[int, int]) -> int:
        """The target rank with the least ``load`` (the most free space); ties go round-robin."""
        self._rr += 1
        order = targets[self._rr % len(targets):] + targets[:self._rr % len(targets)]
        return min(order, key=load.__getitem__)

    def _record_maker_stats(self, maker_id: int, stats: dict) -> None:
        state = self.maker_state[maker_id]
        state.generate_s += stats.get("generate_s", 0.0)
        state.idle_s += stats.get("idle_s", 0.0)
        state.admission_s += stats.get("admission_s", 0.0)
        state.pause_s += stats.get("pause_s", 0.0)
        state.tokens += stats.get("num_tokens", 0)
        self.counters.blank_prompts += stats.get("blank", 0)
        self.counters.truncated_prompts += stats.get("truncated", 0)
        if "logprob_gap" in stats:
            self.logprob_gaps.append(tuple(stats["logprob_gap"]))

    async def pull(self, rank: int, n: int, trainer_version: int, timeout_s: float,
                   pid: int | None = None, step: int | None = None) -> list[ExperienceChunk]:
        """Chunks holding ``n`` items for ``rank``, none older than ``trainer_version - max_staleness``
        (``ray_ppo.transport.resolve`` fetches their items). Their prompts count as trained at ``step``.

        Raises ``RuntimeError`` if a maker failed, ``TimeoutError`` (with what was seen) when
        nothing arrives for ``timeout_s``.
        """
        self._set_trainer_version(trainer_version)
        self.rank_pids[rank] = pid
        out: list[ExperienceChunk] = []
        got = 0
        deadline = time.monotonic() + timeout_s
        async with self.changed:
            self.changed.notify_all()  # admission may have changed with the version
            while got < n:
                self._raise_on_failure()
                self._drop_stale(rank)
                got += self._take(rank, n - got, out)
                if got == n:
                    break
                self.changed.notify_all()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.buffers[rank].extendleft(reversed(out))
                    raise TimeoutError(await self._stall_report(rank, n, got, timeout_s))
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass
            self.counters.consumed += got
            self.counters.in_flight -= got
            self.ledger.consumed((pid for chunk in out for pid in chunk.item_prompt_ids()), step)
            if trainer_version >= self.trainer_version:
                # A rank still finishing the previous version's step (rank 0 already pushed the
                # next one) consumed from that version's budget, not from the new version's.
                self.consumed_at_version += got
            self.changed.notify_all()
        return out

    def _take(self, rank: int, n: int, out: list[ExperienceChunk]) -> int:
        """Move up to ``n`` items from the head of ``rank``'s buffer to ``out`` (splitting a chunk if
        needed, at a group boundary: ``n`` is a multiple of the group size)."""
        buffer, taken = self.buffers[rank], 0
        while buffer and taken < n:
            chunk = buffer.popleft()
            if chunk.count > n - taken:
                chunk, rest = chunk.split(n - taken)
                buffer.appendleft(rest)
            out.append(chunk)
            taken += chunk.count
        return taken

    async def lost_in_transit(self, rank: int, n: int, prompt_ids: list[int] = ()) -> None:
        """Rank ``rank`` pulled ``n`` items whose payload died with their maker: not consumed after
        all; their prompts (``prompt_ids``, one per item) are served again."""
        self.counters.consumed -= n
        self.ledger.requeue(prompt_ids)
        self.consumed_at_version = max(0, self.consumed_at_version - n)
        self.counters.lost_in_transit += n
        async with self.changed:
            self.changed.notify_all()  # admission has room again

    def _set_trainer_version(self, version: int) -> None:
        if version > self.trainer_version:
            self.trainer_version = version
            self.consumed_at_version = 0

    def _drop_stale(self, rank: int) -> None:
        oldest_allowed = self.trainer_version - self.max_staleness
        buffer = self.buffers[rank]
        fresh = [chunk for chunk in buffer if chunk.policy_version >= oldest_allowed]
        dropped = self._buffered(rank) - sum(chunk.count for chunk in fresh)
        if dropped:
            stale = (pid for chunk in buffer if chunk.policy_version < oldest_allowed for pid in chunk.item_prompt_ids())
            self.ledger.requeue(stale)
            buffer.clear()
            buffer.extend(fresh)
            self.counters.discarded += dropped
            self.counters.in_flight -= dropped

    def _raise_on_failure(self) -> None:
        failed = {i: s.failed for i, s in self.maker_state.items() if s.failed}
        if failed:
            maker_id, error = next(iter(failed.items()))
            raise RuntimeError(f"maker_{maker_id} failed ({len(failed)}/{self.num_makers} makers failed): {error}")

    async def _stall_report(self, rank: int, wanted: int, got: int, timeout_s: float) -> str:
        alive = await self._ping_makers()
        details = "; ".join(f"maker_{i}: {status}" for i, status in sorted(alive.items()))
        n_alive = sum(status.startswith("alive") for status in alive.values())
        return (f"rank {rank}: no complete batch for {timeout_s:g} s (got {got}/{wanted} items; "
                f"trainer version {self.trainer_version}, max_staleness {self.max_staleness}); "
                f"makers alive {n_alive}/{self.num_makers}; {details}")

    async def _ping_makers(self) -> dict[int, str]:
        async def ping(i: int) -> str:
            if self.maker_state[i].failed:
                return f"failed: {self.maker_state[i].failed}"
            try:
                await asyncio.wait_for(self.makers[i].ping.remote(), timeout=HEALTH_CHECK_S)
                return f"alive at version {self.maker_state[i].version}"
            except Exception as e:  # a dead actor raises RayActorError; a hung one times out
                return f"not answering ({type(e).__name__})"
        results = await asyncio.gather(*(ping(i) for i in self.makers))
        return dict(zip(self.makers, results))

    async def maker_restarted(self, maker_id: int) -> None:
        """A maker's process was restarted: what it held is lost (counted), its weights are back
        to the initial ones, so it gets the latest push again before it may generate."""
        state = self.maker_state[maker_id]
        self.counters.lost += state.reserved
        self.ledger.maker_lost(maker_id)
        self.reserved -= state.reserved
        state.reserved, state.version = 0, 0
        state.restarts += 1
        if self.latest_push is not None and maker_id in self.makers:
            task = asyncio.get_running_loop().create_task(self._push_to(maker_id, self.makers[maker_id], self.latest_push))
            self.push_tasks.add(task)
            task.add_done_callback(self.push_tasks.discard)
        async with self.changed:
            self.changed.notify_all()

    def maker_failed(self, maker_id: int, error: str) -> None:
        """Called by a maker whose loop raised; the next ``pull`` surfaces the error."""
        self.maker_state[maker_id].failed = error

    # -- weights --------------------------------------------------------------------------------
    async def publish_start(self, version: int, num_chunks: int, nbytes: int, meta: dict) -> None:
        """Open push ``version`` of ``num_chunks`` buckets and start relaying it to every maker;
        its buckets follow one by one (``publish_chunk``), each relayed as soon as it arrives."""
        self._set_trainer_version(version)
        superseded, push = self.latest_push, Push(version, num_chunks, nbytes, meta)
        self.latest_push = push  # older pushes' refs are released here
        self.push_log.append((version, nbytes))
        if superseded is not None:  # its relays still waiting for buckets give up
            async with superseded.arrived:
                superseded.arrived.notify_all()
        for maker_id, handle in self.makers.items():
            task = asyncio.get_running_loop().create_task(self._push_to(maker_id, handle, push))
            self.push_tasks.add(task)
            task.add_done_callback(self.push_tasks.discard)
        async with self.changed:
            self.changed.notify_all()

    async def publish_chunk(self, version: int, index: int, bucket_ref: list) -> None:
        """Bucket ``index`` of push ``version`` (the ref nested, so it is not fetched here)."""
        push = self.latest_push
        if push is None or push.version != version:
            return  # a newer push started: this one is abandoned
        push.bucket_refs[index] = bucket_ref[0]
        async with push.arrived:
            push.arrived.notify_all()

    async def publish_weights(self, version: int, bucket_refs: list, nbytes: int, meta: dict) -> None:
        """A push whose buckets are all put already: ``publish_start`` and every ``publish_chunk``."""
        await self.publish_start(version, len(bucket_refs), nbytes, meta)
        for index, ref in enumerate(bucket_refs):
            await self.publish_chunk(version, index, [ref])

    async def _push_to(self, maker_id: int, handle: Any, push: Push) -> None:
        """chunk_start, one chunk call per bucket as it arrives, chunk_end: ordered calls in the
        maker's ``model_io`` group. A push superseded before all its buckets arrived is not ended
        (the maker drops its staging at the newer chunk_start)."""
        if self._superseded(push):
            return  # superseded before it started: the maker gets the newer one
        try:
            handle.weights_start.remote(push.version, push.num_chunks, push.meta)
            for index in range(push.num_chunks):
                if index not in push.bucket_refs:
                    async with push.arrived:
                        await push.arrived.wait_for(lambda: index in push.bucket_refs or self._superseded(push))
                if self._superseded(push):
                    return
                handle.weights_chunk.remote(push.version, index, [push.bucket_refs[index]])  # nested: the maker fetches it
            loaded = await handle.weights_end.remote(push.version)
        except Exception as e:
            self.maker_state[maker_id].failed = f"weight push v{push.version} failed: {type(e).__name__}: {e}"
            return
        async with self.changed:
            if loaded:
                self.maker_state[maker_id].version = max(self.maker_state[maker_id].version, push.version)
            self.changed.notify_all()

    def _superseded(self, push: Push) -> bool:
        return self.latest_push is not None and self.latest_push.version > push.version

    async def wait_for_version(self, version: int, timeout_s: float) -> dict[int, int]:
        """Wait until every live maker has loaded ``version``; returns each maker's version."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(
                    lambda: all(s.version >= version or s.failed for s in self.maker_state.values())), timeout_s)
            except asyncio.TimeoutError:
                pass
        return {i: s.version for i, s in self.maker_state.items()}

    async def maker_fingerprints(self) -> dict[int, tuple[int, str]]:
        """Each maker's (version, weight fingerprint)."""
        refs = {i: h.weights_fingerprint.remote() for i, h in self.makers.items()}
        return {i: await ref for i, ref in refs.items()}

    # -- metrics and shutdown -------------------------------------------------------------------
    def record_metrics(self, metrics: dict) -> None:
        self.metrics.append(metrics)

    def metrics_since(self, index: int) -> list[dict]:
        return self.metrics[index:]

    def checkpoint_saved(self, step: int, checkpoint: Any) -> None:
        """Rank 0 reported the checkpoint of ``step`` and Ray Train stored it (the driver publishes it)."""
        self.checkpoints.append((step, checkpoint))

    def checkpoints_since(self, index: int) -> list[tuple[int, Any]]:
        return self.checkpoints[index:]

    def data_state(self, step: int | None = None) -> dict:
        """Where a run resumed from the checkpoint of ``step`` continues the prompt stream, by
        prompt identity (``PromptLedger.state``): prompts not trained by ``step`` are served again."""
        return {**self.ledger.state(step), "first_prompt": self._prompts.first_prompt if self._prompts else None}

    async def rewind(self, step: int) -> int:
        """The trainer's worker group restarted from the checkpoint of ``step``: prompts trained
        after it are served again. Returns how many."""
        requeued = self.ledger.rewind(step)
        async with self.changed:
            self.changed.notify_all()
        return requeued

    def logprob_gaps_since(self, index: int) -> list[tuple[float, float, int]]:
        """The engine log-prob gaps of the batches recorded after the first ``index``."""
        return self.logprob_gaps[index:]

    def status(self) -> dict:
        """Counters, versions and maker states, for metrics and tests."""
        return {"counters": self.counters.with_prompts(self.ledger), "trainer_version": self.trainer_version,
                "data": {**self.ledger.summary(), "first_prompt": self._prompts.first_prompt if self._prompts else None},
                "rank_pids": dict(self.rank_pids), "node_id": _node_id(),
                "buffered": [self._buffered(r) for r in range(self.num_ranks)],
                "makers": {i: asdict(s) for i, s in self.maker_state.items()},
                "pushes": list(self.push_log)}

    async def finish(self) -> dict:
        """End of run: makers get no more prompts, waiting sends return. Returns the final status."""
        async with self.changed:
            self.finished = True
            self.changed.notify_all()
        return self.status()


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class PromptFeed:
    """Serves the prompt dataset's texts in the ledger's order (``ray_ppo.ledger``), epoch after epoch.

    The texts are read once, in file order (Ray Data keeps the order only when asked:
    ``execution_options.preserve_order``), and kept in the coordinator: a prompt id names a row,
    so the same row must come back at the same index on every read, also after a resume. The
    read blocks, so it runs in a worker thread of the coordinator's event loop.
    """

    def __init__(self, dataset: Any, ledger: PromptLedger):
        self.dataset, self.ledger = dataset, ledger
        self.texts: list[str | None] | None = None
        self.first_prompt: str | None = None  # the first prompt this feed served (where a resume restarted)
        self._lock = asyncio.Lock()

    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    async def next(self, maker_id: int, n: int) -> PromptBatch:
        async with self._lock:
            if self.texts is None:
                self.texts = await asyncio.to_thread(read_texts, self.dataset)
                self.ledger.configure(len(self.texts))
            ids = self.ledger.take(n, maker_id)
            texts = [self.texts[self.ledger.row(pid)] for pid in ids]
            if self.first_prompt is None:
                self.first_prompt = texts[0]
            return PromptBatch(texts, self.ledger.epoch, ids)


def read_texts(dataset: Any, batch_size: int = 4096) -> list[str | None]:
    """Every prompt text of a Ray Dataset with a ``prompt`` column, in the dataset's order."""
    dataset.context.enable_progress_bars = False  # the driver shows the run's progress
    dataset.context.print_on_execution_start = False  # no plan logged at every read
    dataset.context.execution_options.preserve_order = True
    texts: list[str | None] = []
    for batch in dataset.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=False):
        texts.extend(None if v is None else str(v) for v in batch["prompt"].tolist())
    return texts

"""The coordinator: one named actor per run that relays experience and weights.

Responsibilities:
  - hand out prompt batches to makers from the run's prompt dataset (so a dead maker never
    stalls the others, unlike ``streaming_split``'s per-epoch barrier);
  - admit makers only while their policy version is within ``max_staleness`` of the trainer's;
  - route experience chunks (packed item batches, inline or by ref: ``ray_ppo.runtime.transport``) into
    bounded per-rank buffers, by count and version only (back-pressure: a send waits for space);
  - drop, and count, items that became too stale while buffered;
  - relay weight pushes to makers as ObjectRefs (never tensors) and track each maker's version;
  - keep the run's counters, per-step metrics and maker failures;
  - have a maker evaluate the weights of a step on the held-out prompts (``eval``), makers taking turns;
  - follow every prompt by identity until it is trained (``ray_ppo.runtime.ledger``): prompts whose
    items are discarded or lost are served again, so each is trained on exactly once.

``Coordinator`` is a thin async shell: its state and every decision live in plain synchronous
objects (``ray_ppo.runtime.coordinator_state``, ``ray_ppo.runtime.feed.PromptFeed``, ``ray_ppo.runtime.ledger``), and it
only waits (for buffer space, items, admission, weight buckets) and wakes the waiters. It is a
plain class whose methods are coroutines; ``ray.remote`` turns it into an async actor where it is
created. All its methods run on one event loop (one concurrency group), so its state needs no
locks. Its calls take and return the typed messages of ``ray_ppo.runtime.messages``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from ray_ppo.runtime.coordinator_state import Admission, Mailbox, MakerBook, Push, PushRelay, RankBuffers
from ray_ppo.runtime.feed import PromptFeed
from ray_ppo.runtime.ledger import PromptLedger
from ray_ppo.runtime.messages import (Counters, CoordinatorStatus, EvalReport, MakerStats, Prompt, PromptBatch,
                                     PushHeader)
from ray_ppo.runtime.routing import receivers
from ray_ppo.runtime.transport import ExperienceChunk

HEALTH_CHECK_S = 5.0
"""How long a maker has to answer a ping when the coordinator diagnoses a stall."""


class _Cancelled(Exception):
    """A pull in progress was cancelled (``Coordinator.cancel_pull``)."""


class Coordinator:
    """Responsibilities: wait and wake (sends for buffer space, pulls for items, makers for
    admission, relays for weight buckets), relay pushes to makers, ping makers to diagnose a
    stall. Everything it counts or decides is one of its state objects' (module docstring)."""

    def __init__(self, num_ranks: int, num_makers: int, buffer_size: int, max_staleness: int,
                 items_per_version: int, routing: str = "round_robin", prompts: Any = None,
                 prompt_column: str = "prompt", prompt_batch_size: int = 16, shuffle: bool = True, seed: int = 0,
                 initial_version: int = 0, data_start: dict | None = None, samples_per_prompt: int = 1):
        self.num_ranks, self.num_makers, self.routing = num_ranks, num_makers, routing
        self.buffers = RankBuffers(num_ranks, buffer_size)
        self.admission = Admission(num_makers, max_staleness, items_per_version, prompt_batch_size,
                                   samples_per_prompt, initial_version)
        self.book = MakerBook(num_makers)
        self.pushes = PushRelay()
        self.ledger = PromptLedger(shuffle, seed, data_start)
        self.feed = PromptFeed.of_dataset(prompts, self.ledger, prompt_column) if prompts is not None else None
        self.makers: dict[int, Any] = {}
        self.changed = asyncio.Condition()  # buffers, admission or maker versions changed
        self.pushed = asyncio.Condition()   # a bucket arrived, or a newer push started
        self.loading = asyncio.Lock()       # the prompt texts are read once
        self.push_tasks: set[asyncio.Task] = set()
        self.eval_tasks: set[asyncio.Task] = set()
        self.evals_asked = 0  # evaluations asked for; makers take turns by this count
        self.relays = 0  # relays started; each one's number goes with its calls to the maker
        self.mailbox = Mailbox()
        self.rank_pids: dict[int, int | None] = {}  # process of each trainer rank, for diagnostics
        self.pulling: set[tuple[int, int | None]] = set()    # (rank, pid) of each pull in progress
        self.cancelled: set[tuple[int, int | None]] = set()  # of those, the ones cancelled
        self.group = 0  # the trainer worker group whose pulls are served (``rewind`` starts the next)
        self.finished = False

    # -- set-up ---------------------------------------------------------------------------------
    def register_makers(self, handles: dict[int, Any]) -> None:
        self.makers = dict(handles)

    def ready(self) -> bool:
        return True

    async def _notify(self, condition: asyncio.Condition | None = None) -> None:
        condition = condition or self.changed
        async with condition:
            condition.notify_all()

    # -- prompts --------------------------------------------------------------------------------
    async def next_prompts(self, maker_id: int) -> PromptBatch | None:
        """Next prompt batch for ``maker_id``; waits while the maker is too stale; None once the run
        is over, or once the maker was restarted while this call waited (its caller died with the
        old process, and a batch handed to it would be lost without being counted)."""
        n, restarts = self.admission.prompt_batch_size, self.book.states[maker_id].restarts

        def restarted() -> bool:
            return self.book.states[maker_id].restarts != restarts

        async with self.changed:
            await self.changed.wait_for(lambda: self.finished or restarted() or self._admitted(maker_id))
            if self.finished or restarted():
                return None
            self.admission.reserve(maker_id, n)  # before any await, so admission sees it
        async with self.loading:
            if not self.feed.loaded:
                self.feed.load(await asyncio.to_thread(self.feed.read))
        batch = self.feed.next(maker_id, n)
        if restarted():  # maker_restarted counted the reservation as lost: serve it again
            self.ledger.give_back(maker_id, batch.ids)
            return None
        return batch

    def _admitted(self, maker_id: int) -> bool:
        return self.admission.admits(self.book.states[maker_id].version, self.buffers.in_flight)

    # -- experience -----------------------------------------------------------------------------
    async def send(self, maker_id: int, chunk: ExperienceChunk, stats: MakerStats) -> int:
        """Buffer the chunk's items for the trainer ranks, waiting for space. Returns how many
        were accepted (all, unless the run finished while waiting: the rest are counted in flight)."""
        self.buffers.accept(chunk.count)
        self.admission.reserve(maker_id, -stats.num_prompts)
        self.book.record(maker_id, stats)
        self.ledger.returned(maker_id, stats.prompt_ids, chunk.item_prompt_ids(), stats.truncated)
        targets = receivers(self.routing, maker_id, self.num_makers, self.num_ranks)
        rest = chunk
        async with self.changed:
            while rest.count:
                await self.changed.wait_for(lambda: self.finished or self.buffers.has_space(targets))
                if self.finished:
                    break
                rest = self.buffers.route(rest, targets)
                self.changed.notify_all()  # once per pass, not per item
        return chunk.count - rest.count

    async def pull(self, rank: int, n: int, trainer_version: int, timeout_s: float,
                   pid: int | None = None, step: int | None = None,
                   for_version: int | None = None, group: int | None = None) -> list[ExperienceChunk] | None:
        """Chunks holding ``n`` items for ``rank`` to train at ``for_version`` (default: the rank's
        ``trainer_version``; later when it pulls ahead for its next step), none older than
        ``for_version - max_staleness`` (``ray_ppo.runtime.transport.resolve`` fetches their items).
        Their prompts count as trained at ``step``.

        Raises ``RuntimeError`` if a maker failed, ``TimeoutError`` (with what was seen) when
        nothing arrives for ``timeout_s``; either way the items taken go back to the buffer. Returns
        None, the items taken put back, if it was cancelled while it waited (``cancel_pull``, or
        ``rewind``: its caller's worker group is gone), and None at once, taking nothing, if it
        comes from a worker group that ``rewind`` has replaced (``group``, the number the caller's
        group got from ``rewind``: a dead rank's pull can arrive after its successor's rewind).
        """
        if group is not None and group != self.group:
            return None
        for_version = trainer_version if for_version is None else for_version
        self.admission.trainer_at(trainer_version)
        self.rank_pids[rank] = pid
        key = (rank, pid)
        self.pulling.add(key)  # before any await, so a cancel_pull sent after this call sees it
        out: list[ExperienceChunk] = []
        try:
            async with self.changed:
                self.changed.notify_all()  # admission may have changed with the version
                try:
                    await self._fill(key, n, out, for_version, time.monotonic() + timeout_s, timeout_s)
                except BaseException as e:
                    self.buffers.put_back(rank, out)
                    if isinstance(e, _Cancelled):
                        return None
                    raise
                self.buffers.commit(n)
                self.admission.consumed(n, for_version)
                self.ledger.consumed((pid for chunk in out for pid in chunk.item_prompt_ids()), step)
                self.changed.notify_all()
            return out
        finally:
            self.pulling.discard(key)
            self.cancelled.discard(key)

    async def cancel_pull(self, rank: int, pid: int | None = None) -> None:
        """Cancel the pull of ``rank`` in process ``pid`` if it still waits for items (a pull ahead
        for a step that will not run); a pull that already returned is handed back with
        ``hand_back`` instead."""
        if (rank, pid) in self.pulling:
            self.cancelled.add((rank, pid))
            await self._notify()

    async def hand_back(self, rank: int, chunks: list[ExperienceChunk], for_version: int) -> None:
        """``rank`` pulled ``chunks`` ahead, to train at ``for_version``, for a step that did not run:
        they go back to the head of its buffer, and their prompts count as buffered again."""
        n = self.buffers.handed_back(rank, chunks)
        self.admission.unconsumed(n, for_version)
        self.ledger.unconsumed(pid for chunk in chunks for pid in chunk.item_prompt_ids())
        await self._notify()

    async def _fill(self, key: tuple[int, int | None], n: int, out: list[ExperienceChunk], for_version: int,
                    deadline: float, timeout_s: float) -> None:
        """Take items for the pull ``key`` (rank, pid) into ``out`` until it holds ``n``; called holding ``changed``."""
        rank, got = key[0], 0
        while True:
            if error := self.book.failure():
                raise RuntimeError(error)
            if key in self.cancelled:
                raise _Cancelled
            if stale := self.buffers.drop_stale(rank, self.admission.oldest_allowed_at(for_version)):
                self.ledger.requeue(stale)
            got += self.buffers.take(rank, n - got, out)
            if got == n:
                return
            self.changed.notify_all()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(await self._stall_report(rank, n, got, timeout_s))
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    async def lost_in_transit(self, rank: int, n: int, prompt_ids: list[int] = (),
                              for_version: int | None = None) -> None:
        """Rank ``rank`` pulled ``n`` items, to train at ``for_version``, whose payload died with their
        maker: not consumed after all; their prompts (``prompt_ids``, one per item) are served again."""
        self.buffers.lost(n)
        self.admission.unconsumed(n, for_version)
        self.ledger.requeue(prompt_ids)
        await self._notify()  # admission has room again

    async def _stall_report(self, rank: int, wanted: int, got: int, timeout_s: float) -> str:
        alive = await self._ping_makers()
        details = "; ".join(f"maker_{i}: {status}" for i, status in sorted(alive.items()))
        n_alive = sum(status.startswith("alive") for status in alive.values())
        return (f"rank {rank}: no complete batch for {timeout_s:g} s (got {got}/{wanted} items; "
                f"trainer version {self.admission.trainer_version}, max_staleness {self.admission.max_staleness}); "
                f"makers alive {n_alive}/{self.num_makers}; {details}")

    async def _ping_makers(self) -> dict[int, str]:
        async def ping(i: int) -> str:
            state = self.book.states[i]
            if state.failed:
                return f"failed: {state.failed}"
            try:
                await asyncio.wait_for(self.makers[i].ping.remote(), timeout=HEALTH_CHECK_S)
                return f"alive at version {state.version}"
            except Exception as e:  # a dead actor raises RayActorError; a hung one times out
                return f"not answering ({type(e).__name__})"
        results = await asyncio.gather(*(ping(i) for i in self.makers))
        return dict(zip(self.makers, results))

    async def maker_restarted(self, maker_id: int) -> None:
        """A maker's process was restarted: what it held is lost (counted), its weights are back
        to the initial ones, so it gets the latest push again before it may generate."""
        self.admission.drop(maker_id)
        self.ledger.maker_lost(maker_id)
        self.book.restarted(maker_id)
        await self._notify()
        if self.pushes.latest is not None and maker_id in self.makers:
            self._relay(maker_id, self.makers[maker_id], self.pushes.latest)

    def maker_failed(self, maker_id: int, error: str) -> None:
        """Called by a maker whose loop raised; the next ``pull`` surfaces the error."""
        self.book.fail(maker_id, error)

    # -- weights --------------------------------------------------------------------------------
    async def publish_start(self, header: PushHeader) -> None:
        """Open push ``header.version`` of ``header.num_chunks`` buckets and start relaying it to
        every maker; its buckets follow one by one (``publish_chunk``), each relayed as soon as it arrives."""
        self.admission.trainer_at(header.version)
        push = self.pushes.start(header)
        await self._notify(self.pushed)  # relays of a superseded push still waiting for buckets give up
        for maker_id, handle in self.makers.items():
            self._relay(maker_id, handle, push)
        await self._notify()

    async def publish_chunk(self, version: int, index: int, bucket_ref: list) -> None:
        """Bucket ``index`` of push ``version`` (the ref nested, so it is not fetched here);
        ignored if a newer push started."""
        if self.pushes.add(version, index, bucket_ref[0]):
            await self._notify(self.pushed)

    async def publish_weights(self, header: PushHeader, bucket_refs: list) -> None:
        """A push whose buckets are all put already: ``publish_start`` and every ``publish_chunk``."""
        if len(bucket_refs) != header.num_chunks:
            raise ValueError(f"push v{header.version} announces {header.num_chunks} buckets but brings "
                             f"{len(bucket_refs)}: build its PushHeader with num_chunks=len(bucket_refs)")
        await self.publish_start(header)
        for index, ref in enumerate(bucket_refs):
            await self.publish_chunk(header.version, index, [ref])

    def _relay(self, maker_id: int, handle: Any, push: Push) -> None:
        self.relays += 1
        task = asyncio.get_running_loop().create_task(self._push_to(maker_id, handle, push, self.relays))
        self.push_tasks.add(task)
        task.add_done_callback(self.push_tasks.discard)

    async def _push_to(self, maker_id: int, handle: Any, push: Push, relay: int) -> None:
        """chunk_start, one chunk call per bucket as it arrives, chunk_end, in the maker's
        ``model_io`` group. A threaded actor does not promise to run one caller's calls in the
        order they were sent, so chunks go out once chunk_start has run, and chunk_end once every
        chunk has (a chunk's error then fails the push here instead of vanishing). A push
        superseded before all its buckets arrived is not ended (the maker drops its staging at
        the newer chunk_start); a late chunk_end of an older push leaves the newer push's staging
        alone (``WeightReceiver.end``). Every call carries ``relay``, this relay's number: a
        maker that restarted gets the latest push again while Ray retries the calls of the relay
        its old process died in, and a retried call of the older relay must not touch the newer
        relay's staging of the same push."""
        if self.pushes.superseded(push):
            return  # superseded before it started: the maker gets the newer one
        try:
            await handle.weights_start.remote(push.header, relay)
            chunks = []
            for index in range(push.header.num_chunks):
                async with self.pushed:
                    await self.pushed.wait_for(lambda: index in push.bucket_refs or self.pushes.superseded(push))
                if self.pushes.superseded(push):
                    return
                chunks.append(handle.weights_chunk.remote(push.version, index, [push.bucket_refs[index]], relay))  # nested: the maker fetches it
            await asyncio.gather(*chunks)
            loaded = await handle.weights_end.remote(push.version, relay)
        except Exception as e:
            self.book.fail(maker_id, f"weight push v{push.version} failed: {type(e).__name__}: {e}")
            return
        if loaded:
            self.book.loaded(maker_id, push.version)
        await self._notify()

    async def wait_for_version(self, version: int, timeout_s: float) -> dict[int, int]:
        """Wait until every live maker has loaded ``version``; returns each maker's version."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.book.all_at(version)), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.book.versions()

    async def maker_fingerprints(self) -> dict[int, tuple[int, str]]:
        """Each maker's (version, weight fingerprint)."""
        refs = {i: h.weights_fingerprint.remote() for i, h in self.makers.items()}
        return {i: await ref for i, ref in refs.items()}

    # -- evaluation -----------------------------------------------------------------------------
    def request_eval(self, step: int, version: int) -> None:
        """Have a maker evaluate the weights of ``step`` (push ``version``) in the background; its
        ``EvalReport`` joins the mailbox (``evals_since``). Live makers take turns; an evaluation
        that fails is reported with its error, and the run goes on."""
        live = [i for i in sorted(self.makers) if not self.book.states[i].failed]
        self.evals_asked += 1
        if not live:
            self.mailbox.evals.append(EvalReport(step=step, policy_version=version, error="no live maker to evaluate"))
            return
        maker_id = live[(self.evals_asked - 1) % len(live)]
        task = asyncio.get_running_loop().create_task(self._evaluate(maker_id, step, version))
        self.eval_tasks.add(task)
        task.add_done_callback(self.eval_tasks.discard)

    async def _evaluate(self, maker_id: int, step: int, version: int) -> None:
        try:
            report = await self.makers[maker_id].evaluate.remote(step, version)
        except Exception as e:  # a RayTaskError carries the maker's own exception as its cause
            cause = getattr(e, "cause", None) or e
            first = (str(cause).strip().splitlines() or [""])[0]
            report = EvalReport(step=step, policy_version=version, maker_id=maker_id,
                                error=f"{type(cause).__name__}: {first}")
        self.mailbox.evals.append(report)

    async def evals_done(self) -> None:
        """Return once every evaluation asked for has reported (the run's last step waits for its own)."""
        while self.eval_tasks:
            await asyncio.wait(set(self.eval_tasks))

    def evals_since(self, index: int) -> list[EvalReport]:
        return self.mailbox.evals[index:]

    # -- metrics and shutdown -------------------------------------------------------------------
    def record_metrics(self, metrics: dict) -> None:
        self.mailbox.metrics.append(metrics)

    def metrics_since(self, index: int) -> list[dict]:
        return self.mailbox.metrics[index:]

    def checkpoint_saved(self, step: int, checkpoint: Any) -> None:
        """Rank 0 reported the checkpoint of ``step`` and Ray Train stored it (the driver publishes it)."""
        self.mailbox.checkpoints.append((step, checkpoint))

    def checkpoints_since(self, index: int) -> list[tuple[int, Any]]:
        return self.mailbox.checkpoints[index:]

    def data_state(self, step: int | None = None) -> dict:
        """Where a run resumed from the checkpoint of ``step`` continues the prompt stream, by
        prompt identity (``PromptLedger.state``): prompts not trained by ``step`` are served again."""
        return {**self.ledger.state(step), "first_prompt": self._first_prompt()}

    async def rewind(self, step: int) -> int:
        """A trainer worker group starts (also a run's first) from the checkpoint of ``step``:
        prompts trained after it are served again. Returns the group's number, which its ranks
        pass with every ``pull``."""
        self.ledger.rewind(step)
        # Pulls of an earlier group belong to processes that died (the new group pulls only after
        # this): had they taken items for a dead caller, a step the new group redoes would count
        # them as trained. Those still waiting are cancelled, and put their items back; those still
        # on their way are refused when they arrive (their group number is an old one).
        self.cancelled |= self.pulling
        self.admission.restart()  # nothing the dead group pulled was trained by the new one
        self.group += 1
        await self._notify()
        return self.group

    def logprob_gaps_since(self, index: int) -> list[tuple[float, float, int]]:
        """The engine log-prob gaps of the batches recorded after the first ``index``."""
        return self.book.logprob_gaps[index:]

    def _first_prompt(self) -> Prompt | None:
        return self.feed.first_prompt if self.feed else None

    def counters(self, step: int | None = None) -> Counters:
        """This coordinator's item counts and the run's prompt counts (the ledger's, which a resumed
        run carries on); ``prompts_trained`` counts the prompts trained at steps up to ``step``
        (all so far when None)."""
        b, counts = self.buffers, self.ledger.counts
        return Counters(produced=b.produced, consumed=b.consumed, discarded=b.discarded, lost=counts["lost"],
                        lost_in_transit=b.lost_in_transit, in_flight=b.in_flight,
                        prompts_served=counts["taken"], blank_prompts=counts["blank"],
                        truncated_prompts=counts["truncated"], epochs=self.feed.epochs if self.feed else 0,
                        prompts_trained=self.ledger.trained_by(step), prompts_requeued=counts["requeued"])

    def status(self, step: int | None = None) -> CoordinatorStatus:
        """Counters (as of ``step``: ``counters``), versions and maker states, for metrics and
        tests (of fixed size: no logs)."""
        return CoordinatorStatus(
            counters=self.counters(step), trainer_version=self.admission.trainer_version,
            data={**self.ledger.summary(), "first_prompt": self._first_prompt()},
            buffered=tuple(self.buffers.buffered(r) for r in range(self.num_ranks)),
            makers=self.book.snapshot(self.admission.reserved), pushes=self.pushes.count,
            last_push=self.pushes.last, rank_pids=dict(self.rank_pids), node_id=_node_id())

    async def finish(self) -> CoordinatorStatus:
        """End of run: makers get no more prompts, waiting sends return. Returns the final status."""
        self.finished = True
        await self._notify()
        return self.status()


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class CoordinatorActor(Coordinator):
    """The coordinator in the actor process ``fit()`` starts for it.

    Its only blocking ``ray.get`` calls are Ray Data's, made in a worker thread while the prompt
    feed reads the dataset (``asyncio.to_thread``), never on the event loop. Ray's check for
    blocking gets in async actors cannot tell the threads apart and would warn anyway, so it is
    turned off in this process, as Ray Train turns it off for its controller. It is set here and
    not as the actor's ``runtime_env``: an actor with a runtime_env of its own cannot take one of
    Ray's prestarted worker processes and waits for a new one to start, 2-3 s longer on 2 cores
    (benchmarks/README, Start-up).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        super().__init__(*args, **kwargs)

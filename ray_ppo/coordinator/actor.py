"""The coordinator: one named actor per run that relays experience and weights.

Responsibilities:
  - hand out prompt batches to makers from the run's prompt dataset (so a dead maker never
    stalls the others, unlike ``streaming_split``'s per-epoch barrier);
  - admit makers only while their policy version is within ``max_staleness`` of the trainer's;
  - route experience chunks (packed item batches, inline or by ref: ``ray_ppo.wire.transport``) into
    bounded per-rank buffers, by count and version only (back-pressure: a send waits for space);
  - drop, and count, items that became too stale while buffered;
  - relay weight pushes to makers as ObjectRefs (never tensors) and track each maker's version;
  - keep the run's counters, per-step metrics and maker failures;
  - have a maker evaluate the weights of a step on the held-out prompts (``eval``), makers taking turns;
  - follow every prompt by identity until it is trained (``ray_ppo.coordinator.ledger``): prompts whose
    items are discarded or lost are served again, so each is trained on exactly once.

``Coordinator`` is a thin async shell: its state and every decision live in one plain synchronous
``CoordinatorState`` (``ray_ppo.coordinator.state``), one transaction per call, and it only
waits (for buffer space, items, admission, weight buckets) and wakes the waiters. It is a
plain class whose methods are coroutines; ``ray.remote`` turns it into an async actor where it is
created. All its methods run on one event loop (one concurrency group), so its state needs no
locks. Its calls take and return the typed messages of ``ray_ppo.wire.messages``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.coordinator.state import CoordinatorState, PullCancelled, Push
from ray_ppo.wire.messages import (
    CoordinatorStatus,
    Counters,
    EvalReport,
    ItemsLost,
    MakerStats,
    PromptBatch,
    PullOutcome,
    PullReply,
    PullRequest,
    PushHeader,
)
from ray_ppo.wire.transport import ExperienceChunk

if TYPE_CHECKING:
    from ray_ppo.config import Config

HEALTH_CHECK_S = 5.0
"""How long a maker has to answer a ping when the coordinator diagnoses a stall."""


class Coordinator:
    """Responsibilities: wait and wake (sends for buffer space, pulls for items, makers for
    admission, relays for weight buckets), relay pushes to makers, run evaluations on them, ping
    them to diagnose a stall. What it counts or decides is its ``state``'s (a ``CoordinatorState``):
    each call runs one of its transactions."""

    def __init__(self, cfg: Config, prompts: Any = None, prompt_column: str = "prompt", initial_version: int = 0,
                 data_start: dict | None = None):
        """The coordinator of a run of ``cfg`` (``CoordinatorState.of_config`` reads its sections;
        ``data.shuffle`` and ``seed`` order the prompts), serving ``prompt_column`` of the Ray
        Dataset ``prompts`` (None: no prompts, for tests of the experience path). A resumed run
        starts at its checkpoint's ``initial_version`` and prompt-stream position ``data_start``
        (``RunState.policy_version`` and ``RunState.data``)."""
        ledger = PromptLedger(cfg.data.shuffle, cfg.seed, data_start)
        feed = PromptFeed.of_dataset(prompts, ledger, prompt_column) if prompts is not None else None
        self.state = CoordinatorState.of_config(cfg, initial_version, ledger, feed)
        self.makers: dict[int, Any] = {}
        self.changed = asyncio.Condition()  # buffers, admission or maker versions changed
        self.pushed = asyncio.Condition()   # a bucket arrived, or a newer push started
        self.loading = asyncio.Lock()       # the prompt texts are read once
        self.push_tasks: set[asyncio.Task] = set()
        self.eval_tasks: set[asyncio.Task] = set()

    # -- set-up ---------------------------------------------------------------------------------
    def register_makers(self, handles: dict[int, Any]) -> None:
        self.makers = dict(handles)
        self.state.on_register(list(handles))

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
        ask = self.state.on_ask(maker_id)
        async with self.changed:
            await self.changed.wait_for(lambda: self.state.may_answer(ask))
            if not self.state.on_admit(ask):
                return None
        async with self.loading:
            if (read := self.state.prompts_to_read()) is not None:
                self.state.on_prompts_read(await asyncio.to_thread(read))
        return self.state.on_serve(ask)

    # -- experience -----------------------------------------------------------------------------
    async def send(self, maker_id: int, chunk: ExperienceChunk, stats: MakerStats) -> int:
        """Buffer the chunk's items for the trainer ranks, waiting for space. Returns how many
        were accepted (all, unless the run finished while waiting: the rest are counted in flight)."""
        targets = self.state.on_send(maker_id, chunk, stats)
        rest = chunk
        async with self.changed:
            while rest.count and not self.state.finished:
                await self.changed.wait_for(lambda: self.state.may_place(targets))
                rest = self.state.on_place(rest, targets)
                self.changed.notify_all()  # once per pass, not per item
        return chunk.count - rest.count

    async def pull(self, request: PullRequest) -> PullReply:
        """Chunks holding ``request.n`` items for the rank to train at ``request.version``, none older
        than that version's ``max_staleness`` allows (``ray_ppo.wire.transport.resolve`` fetches
        their items). Their prompts count as trained at ``request.step``.

        Raises ``RuntimeError`` if a maker failed (with the maker's traceback: ``MakerBook.failure``),
        ``TimeoutError`` (with what was seen) when nothing arrives for ``request.timeout_s``; either
        way the items taken go back to the buffer. The reply's outcome is ``PullOutcome.CANCELLED``,
        the items taken put back, if the pull was cancelled while it waited (``cancel_pull``, or
        ``rewind``: its caller's worker group is gone), and ``REPLACED`` at once, taking nothing, if
        it comes from a worker group that ``rewind`` has replaced (a dead rank's pull can arrive
        after its successor's rewind).
        """
        pull = self.state.on_pull(request)
        if pull is None:
            return PullReply(outcome=PullOutcome.REPLACED)
        deadline = time.monotonic() + request.timeout_s
        try:
            async with self.changed:
                self.changed.notify_all()  # admission may have changed with the version
                while not self.state.on_pull_attempt(pull):
                    self.changed.notify_all()  # what was taken freed buffer space
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(await self._stall_report(request, pull.got))
                    try:
                        await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 1.0))
                    except asyncio.TimeoutError:
                        pass
                chunks = self.state.on_pull_committed(pull)
                self.changed.notify_all()
            return PullReply(chunks)
        except PullCancelled:
            self.state.on_pull_abandoned(pull)
            return PullReply(outcome=PullOutcome.CANCELLED)
        except BaseException:
            self.state.on_pull_abandoned(pull)
            raise

    async def cancel_pull(self, rank: int, pid: int | None = None) -> None:
        """Cancel the pull of ``rank`` in process ``pid`` if it still waits for items (a pull ahead
        for a step that will not run); a pull that already returned is handed back with
        ``hand_back`` instead."""
        if self.state.on_cancel_pull(rank, pid):
            await self._notify()

    async def hand_back(self, rank: int, chunks: list[ExperienceChunk], for_version: int) -> None:
        """``rank`` pulled ``chunks`` ahead, to train at ``for_version``, for a step that did not run:
        they go back to the head of its buffer, and their prompts count as buffered again."""
        self.state.on_hand_back(rank, chunks, for_version)
        await self._notify()

    async def lost_in_transit(self, lost: ItemsLost) -> None:
        """Pulled items whose payload died with their maker (``ItemsLost``): admission has room again."""
        self.state.on_items_lost(lost)
        await self._notify()

    async def _stall_report(self, request: PullRequest, got: int) -> str:
        alive = await self._ping_makers()
        details = "; ".join(f"maker_{i}: {status}" for i, status in sorted(alive.items()))
        n_alive = sum(status.startswith("alive") for status in alive.values())
        admission = self.state.admission
        return (f"rank {request.rank}: no complete batch for {request.timeout_s:g} s (got {got}/{request.n} items; "
                f"trainer version {admission.trainer_version}, max_staleness {admission.max_staleness}); "
                f"makers alive {n_alive}/{self.state.num_makers}; {details}")

    async def _ping_makers(self) -> dict[int, str]:
        async def ping(i: int) -> str:
            state = self.state.book.states[i]
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
        push = self.state.on_maker_restarted(maker_id)
        await self._notify()
        if push is not None:
            self._relay(maker_id, self.makers[maker_id], push)

    def maker_failed(self, maker_id: int, error: str, origin_traceback: str = "") -> None:
        """Called by a maker whose loop raised (``error`` in one line, and the loop's traceback), or by
        the driver for a maker that died; the next ``pull`` raises the error with that traceback."""
        self.state.on_maker_failed(maker_id, error, origin_traceback)

    # -- weights --------------------------------------------------------------------------------
    async def publish_start(self, header: PushHeader) -> None:
        """Open push ``header.version`` of ``header.num_chunks`` buckets and start relaying it to
        every maker; its buckets follow one by one (``publish_chunk``), each relayed as soon as it arrives."""
        push = self.state.on_push_start(header)
        await self._notify(self.pushed)  # relays of a superseded push still waiting for buckets give up
        for maker_id, handle in self.makers.items():
            self._relay(maker_id, handle, push)
        await self._notify()

    async def publish_chunk(self, version: int, index: int, bucket_ref: list) -> None:
        """Bucket ``index`` of push ``version`` (the ref nested, so it is not fetched here);
        ignored if a newer push started."""
        if self.state.on_push_bucket(version, index, bucket_ref[0]):
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
        relay = self.state.on_relay()
        task = asyncio.get_running_loop().create_task(self._push_to(maker_id, handle, push, relay))
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
        if self.state.superseded(push):
            return  # superseded before it started: the maker gets the newer one
        try:
            await handle.weights_start.remote(push.header, relay)
            chunks = []
            for index in range(push.header.num_chunks):
                async with self.pushed:
                    await self.pushed.wait_for(lambda: self.state.may_relay_bucket(push, index))
                if (ref := self.state.bucket(push, index)) is None:
                    return
                chunks.append(handle.weights_chunk.remote(push.version, index, [ref], relay))  # nested: the maker fetches it
            await asyncio.gather(*chunks)
            loaded = await handle.weights_end.remote(push.version, relay)
        except Exception as e:
            self.state.on_relay_failed(maker_id, push, f"{type(e).__name__}: {e}")
            return
        self.state.on_relay_ended(maker_id, push, loaded)
        await self._notify()

    async def wait_for_version(self, version: int, timeout_s: float) -> dict[int, int]:
        """Wait until every live maker has loaded ``version``; returns each maker's version."""
        book = self.state.book
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: book.all_at(version)), timeout_s)
            except asyncio.TimeoutError:
                pass
        return book.versions()

    async def maker_fingerprints(self) -> dict[int, tuple[int, str]]:
        """Each maker's (version, weight fingerprint)."""
        refs = {i: h.weights_fingerprint.remote() for i, h in self.makers.items()}
        return {i: await ref for i, ref in refs.items()}

    # -- evaluation -----------------------------------------------------------------------------
    def request_eval(self, step: int, version: int) -> None:
        """Have a maker evaluate the weights of ``step`` (push ``version``) in the background; its
        ``EvalReport`` joins the mailbox (``evals_since``). Live makers take turns; an evaluation
        that fails is reported with its error, and the run goes on."""
        maker_id = self.state.on_eval_request(step, version)
        if maker_id is None:
            return
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
        self.state.on_eval_report(report)

    async def evals_done(self) -> None:
        """Return once every evaluation asked for has reported (the run's last step waits for its own)."""
        while self.eval_tasks:
            await asyncio.wait(set(self.eval_tasks))

    def evals_since(self, index: int) -> list[EvalReport]:
        return self.state.evals_since(index)

    # -- metrics and shutdown -------------------------------------------------------------------
    def record_metrics(self, metrics: dict) -> None:
        self.state.on_metrics(metrics)

    def metrics_since(self, index: int) -> list[dict]:
        return self.state.metrics_since(index)

    def checkpoint_saved(self, step: int, checkpoint: Any) -> None:
        """Rank 0 reported the checkpoint of ``step`` and Ray Train stored it (the driver publishes it)."""
        self.state.on_checkpoint_saved(step, checkpoint)

    def checkpoints_since(self, index: int) -> list[tuple[int, Any]]:
        return self.state.checkpoints_since(index)

    def data_state(self, step: int | None = None) -> dict:
        """Where a run resumed from the checkpoint of ``step`` continues the prompt stream, by
        prompt identity (``PromptLedger.state``): prompts not trained by ``step`` are served again."""
        return self.state.data_state(step)

    async def rewind(self, step: int) -> int:
        """A trainer worker group starts (also a run's first) from the checkpoint of ``step``
        (``CoordinatorState.on_rewind``). Returns the group's number, which its ranks pass with
        every pull."""
        group = self.state.on_rewind(step)
        await self._notify()  # cancelled pulls put their items back
        return group

    def logprob_gaps_since(self, index: int) -> list[tuple[float, float, int]]:
        """The engine log-prob gaps of the batches recorded after the first ``index``."""
        return self.state.book.logprob_gaps[index:]

    def counters(self, step: int | None = None) -> Counters:
        """``CoordinatorState.counters``."""
        return self.state.counters(step)

    def status(self, step: int | None = None) -> CoordinatorStatus:
        """Counters (as of ``step``), versions and maker states, for metrics and tests (of fixed
        size: no logs)."""
        return self.state.status(step, node_id=_node_id())

    async def finish(self) -> CoordinatorStatus:
        """End of run: makers get no more prompts, waiting sends return. Returns the final status."""
        self.state.on_finish()
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
    Ray's prestarted worker processes and waits for a new one to start (benchmarks/README.md,
    "Start-up", measures what that costs).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        super().__init__(*args, **kwargs)

"""The coordinator's state as plain, synchronous objects (no asyncio, no Ray).

``CoordinatorState`` is the whole of it: one transaction (``on_...``) per remote call of the
coordinator, owning every rule (admission, routing, groups, cancellation, the ledger's view).
``ray_ppo.coordinator.actor.Coordinator`` is the async actor shell around it: it waits (for
buffer space, for items, for admission, for weight buckets) and calls one transaction per call or
wake-up. The state is made of objects with one job each, and each counter is changed in one place:

  - ``RankBuffers``: per-rank bounded buffers of experience chunks and the item counters
    (``produced = consumed + in_flight + discarded + lost_in_transit`` by construction);
  - ``Admission``: the trainer's version, the items consumed at it, the prompts reserved by each
    maker, and whether a maker may take another prompt batch;
  - ``MakerBook``: each maker's version, failure, restarts and reported totals;
  - ``PushRelay``: the latest weight push and the refs of its buckets as they arrive;
  - ``Mailbox``: what rank 0 hands the driver (per-step metrics, stored checkpoints), in order.

The prompt stream is ``ray_ppo.coordinator.feed.PromptFeed`` over a ``ray_ppo.coordinator.ledger.PromptLedger``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ray_ppo.config.rules import staleness_budget
from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.coordinator.routing import receivers
from ray_ppo.wire.messages import (
    CoordinatorStatus,
    Counters,
    EvalReport,
    ItemsLost,
    LastPush,
    MakerStats,
    MakerStatus,
    Prompt,
    PromptBatch,
    PullRequest,
    PushHeader,
)
from ray_ppo.wire.transport import ExperienceChunk

if TYPE_CHECKING:
    from ray_ppo.config import Config


class RankBuffers:
    """Responsibilities: hold each trainer rank's chunks (FIFO, at most ``buffer_size`` items),
    deal arriving chunks' groups to the ranks (by tokens or by free space), hand out and take back
    items, drop stale ones, count.

    Stored counters: ``produced`` (items makers sent), ``pulled`` (items ranks took for a step),
    ``discarded`` (dropped as too stale), ``lost_in_transit`` (pulled, but their payload died with
    its maker). ``consumed`` and ``in_flight`` are derived from them, so the accounting identity
    cannot drift.
    """

    def __init__(self, num_ranks: int, buffer_size: int, step_items: int = 0, balance: str = "count"):
        """``step_items``: the items a rank pulls for a step (``trainer.train_batch_size``); with
        ``balance="tokens"`` and more than one rank, groups are dealt so that each rank's next
        ``step_items`` items hold about as many tokens as the other ranks' (``topology.balance``)."""
        self.buffer_size = buffer_size
        self.queues: list[collections.deque[ExperienceChunk]] = [collections.deque() for _ in range(num_ranks)]
        self.produced = self.pulled = self.discarded = self.lost_in_transit = 0
        self._rr = 0
        self.step_items, self.balance = step_items, balance
        self.taken = [0] * num_ranks  # items each rank's pulls took (net of put-backs): where its buffer starts
        self.taken_tokens = [0] * num_ranks  # of those, the tokens of the step a pull is taking now

    @property
    def consumed(self) -> int:
        """Items ranks trained on: pulled and not lost in transit."""
        return self.pulled - self.lost_in_transit

    @property
    def in_flight(self) -> int:
        """Items buffered or waiting for buffer space (or never placed: a run that finished first)."""
        return self.produced - self.pulled - self.discarded

    def accept(self, n: int) -> None:
        """A maker handed ``n`` items to the coordinator; they are placed as space frees up."""
        self.produced += n

    def buffered(self, rank: int) -> int:
        """Items in ``rank``'s buffer."""
        return sum(chunk.count for chunk in self.queues[rank])

    def has_space(self, targets: list[int]) -> bool:
        return any(self.buffered(r) < self.buffer_size for r in targets)

    def route(self, chunk: ExperienceChunk, targets: list[int]) -> ExperienceChunk:
        """Place as many of the chunk's groups as fit, each on the target rank with the most free
        space (ties round-robin), as one slice per rank; returns the slice that did not fit. A
        group (``chunk.group_size`` items, the responses to one prompt) is never split: buffer
        sizes and batch sizes are multiples of it (``Config._groups_stay_whole``). Dealt by tokens
        instead where ``_deals_tokens``."""
        if self._deals_tokens(chunk, targets):
            return self._deal_tokens(chunk, targets)
        load = {r: self.buffered(r) for r in targets}
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
                self.queues[rank].append(head)
        return chunk

    def _deals_tokens(self, chunk: ExperienceChunk, targets: list[int]) -> bool:
        """Deal by tokens: asked for, several ranks, every rank a target (round_robin routing; the
        modulo rule ties a maker to its ranks), and the chunk's lengths known."""
        return (self.balance == "tokens" and len(self.queues) > 1 and self.step_items > 0
                and len(set(targets)) == len(self.queues) and chunk.lengths is not None)

    def _deal_tokens(self, chunk: ExperienceChunk, targets: list[int]) -> ExperienceChunk:
        """Each group in turn goes to a rank with free space: one that has been dealt the fewest
        whole steps (``step_items`` items each, counting what its pulls took, so the ranks fill
        the same step together), of those the one with the fewest tokens in that step so far
        (ties round-robin). When a group completes the same step on every rank, and no pull has
        taken any of it yet, that step's groups are dealt again, longest first (``_redeal``). A
        rank pulls its buffer in order, a step at a time, so the steps it trains are the ones
        dealt here. Returns the groups that did not fit, as ``route``."""
        g, n, placed = chunk.group_size, self.step_items, []
        load = {r: self.buffered(r) for r in targets}
        dealt = {r: self.taken[r] + load[r] for r in targets}
        filling = {r: self._filling_tokens(r, dealt[r] % n, load[r]) for r in targets}
        for tokens in chunk.group_tokens():
            open_ranks = [r for r in targets if load[r] < self.buffer_size]
            if not open_ranks:
                break
            rank = min(self._rotated(open_ranks), key=lambda r: (dealt[r] // n, filling[r]))
            load[rank] += g
            dealt[rank] += g
            filling[rank] = 0 if dealt[rank] % n == 0 else filling[rank] + tokens
            placed.append(rank)
        start = chunk.start
        for rank, run in itertools.groupby(placed):  # consecutive groups of one rank: one slice
            stop = start + g * len(list(run))
            self.queues[rank].append(dataclasses.replace(chunk, start=start, stop=stop))
            start = stop
        steps = {dealt[r] // n for r in targets}
        if placed and len(steps) == 1 and all(dealt[r] % n == 0 and load[r] >= n for r in targets):
            self._redeal(targets)
        return dataclasses.replace(chunk, start=start)

    def _filling_tokens(self, rank: int, partial: int, buffered: int) -> int:
        """The tokens of the ``partial`` items of ``rank``'s step being filled: the last of its
        buffer, and before them those its pull already took."""
        return self._last_tokens(rank, min(partial, buffered)) + (self.taken_tokens[rank] if partial > buffered else 0)

    def _redeal(self, targets: list[int]) -> None:
        """The last ``step_items`` items of every rank's buffer (the step just completed, which no
        pull has touched) dealt again: groups longest first, each to the rank with the fewest tokens
        of those still short of the step's groups; each group a slice of its own."""
        n, groups = self.step_items, []
        for r in targets:
            k = n
            while k:
                chunk = self.queues[r].pop()
                if chunk.count > k:
                    keep, chunk = chunk.split(chunk.count - k)
                    self.queues[r].append(keep)
                k -= chunk.count
                g = chunk.group_size
                tokens_of = chunk.group_tokens() or [0] * (chunk.count // g)  # unknown lengths count 0
                groups += [(tokens, dataclasses.replace(chunk, start=chunk.start + i * g, stop=chunk.start + (i + 1) * g))
                           for i, tokens in enumerate(tokens_of)]
        per_rank = len(groups) // len(targets)
        total, count = dict.fromkeys(targets, 0), dict.fromkeys(targets, 0)
        for tokens, group in sorted(groups, key=lambda tg: -tg[0]):
            rank = min((r for r in targets if count[r] < per_rank), key=total.__getitem__)
            self.queues[rank].append(group)
            total[rank] += tokens
            count[rank] += 1

    def _last_tokens(self, rank: int, k: int) -> int:
        """The tokens of the last ``k`` items of ``rank``'s buffer (items of unknown length count 0)."""
        total = 0
        for chunk in reversed(self.queues[rank]):
            if k <= 0:
                break
            take = min(k, chunk.count)
            total += chunk.tokens(chunk.stop - take, chunk.stop)
            k -= take
        return total

    def _pick(self, targets: list[int], load: dict[int, int]) -> int:
        """The target rank with the least ``load`` (the most free space); ties go round-robin."""
        return min(self._rotated(targets), key=load.__getitem__)

    def _rotated(self, ranks: list[int]) -> list[int]:
        """``ranks`` rotated one further at each call, so that ``min`` breaks ties round-robin."""
        self._rr += 1
        return ranks[self._rr % len(ranks):] + ranks[:self._rr % len(ranks)]

    def take(self, rank: int, n: int, out: list[ExperienceChunk]) -> int:
        """Move up to ``n`` items from the head of ``rank``'s buffer to ``out`` (splitting a chunk if
        needed, at a group boundary: ``n`` is a multiple of the group size). Not counted as pulled
        until ``commit``; ``put_back`` returns them."""
        buffer, taken = self.queues[rank], 0
        while buffer and taken < n:
            chunk = buffer.popleft()
            if chunk.count > n - taken:
                chunk, rest = chunk.split(n - taken)
                buffer.appendleft(rest)
            out.append(chunk)
            taken += chunk.count
            self._took(rank, chunk, 1)
        return taken

    def put_back(self, rank: int, taken: list[ExperienceChunk]) -> None:
        """Return chunks ``take`` moved out (a pull that gave up) to the head of the buffer, in order."""
        self.queues[rank].extendleft(reversed(taken))
        for chunk in taken:
            self._took(rank, chunk, -1)

    def _took(self, rank: int, chunk: ExperienceChunk, sign: int) -> None:
        """Count ``chunk`` as taken from (1) or put back to (-1) ``rank``'s buffer, for the deal by tokens."""
        self.taken[rank] += sign * chunk.count
        if self.step_items and self.taken[rank] % self.step_items == 0:
            self.taken_tokens[rank] = 0  # a step's pull is complete, or none has begun
        else:
            self.taken_tokens[rank] += sign * chunk.tokens()

    def commit(self, n: int) -> None:
        """A rank leaves with ``n`` taken items."""
        self.pulled += n

    def handed_back(self, rank: int, chunks: list[ExperienceChunk]) -> int:
        """Chunks a rank pulled and did not train on (pulled ahead for a step that did not run) go
        back to the head of its buffer, uncounted as pulled; returns their item count."""
        self.put_back(rank, chunks)
        n = sum(chunk.count for chunk in chunks)
        self.pulled -= n
        return n

    def lost(self, n: int) -> None:
        """``n`` pulled items could not be fetched: their payload died with its maker."""
        self.lost_in_transit += n

    def drop_stale(self, rank: int, oldest_allowed: int) -> list[int]:
        """Drop (and count) ``rank``'s chunks made before version ``oldest_allowed``; returns the
        prompt ids of the dropped items."""
        buffer = self.queues[rank]
        stale = [chunk for chunk in buffer if chunk.policy_version < oldest_allowed]
        if not stale:
            return []
        fresh = [chunk for chunk in buffer if chunk.policy_version >= oldest_allowed]
        buffer.clear()
        buffer.extend(fresh)
        self.discarded += sum(chunk.count for chunk in stale)
        return [pid for chunk in stale for pid in chunk.item_prompt_ids()]


class Admission:
    """Responsibilities: know the trainer's version and what it consumed at it, keep each maker's
    reserved prompts (handed out, items not yet back; lost when the maker restarts), and decide
    whether a maker may take another batch.

    Items made at maker version v are usable while the trainer's version is <= v + S
    (``max_staleness``); until then the trainer consumes at most ``(v + S - V + 1) *
    items_per_version`` items, minus what it already consumed at its current version V. A prompt
    reserved or handed out becomes ``samples_per_prompt`` items. A rank may pull ahead, for the
    version its next step will train at (``trainer.prefetch``): those items come out of the same
    budget, counted under their version (``ahead``) until the trainer reaches it.
    """

    def __init__(self, num_makers: int, max_staleness: int, items_per_version: int, prompt_batch_size: int,
                 samples_per_prompt: int = 1, initial_version: int = 0):
        self.max_staleness, self.items_per_version = max_staleness, items_per_version
        self.prompt_batch_size, self.samples_per_prompt = prompt_batch_size, samples_per_prompt
        self.trainer_version = initial_version  # > 0 when resuming: makers wait for the restored weights
        self.consumed_at_version = 0  # items pulled since the trainer reached its current version
        self.ahead: dict[int, int] = {}  # version > trainer_version -> items pulled to train at it
        self.reserved = dict.fromkeys(range(num_makers), 0)

    @property
    def total_reserved(self) -> int:
        return sum(self.reserved.values())

    def admits(self, maker_version: int, in_flight: int) -> bool:
        """Whether a maker at ``maker_version`` may take a batch, counting ``in_flight`` items and
        every reserved prompt."""
        lag = self.trainer_version - maker_version
        capacity = (staleness_budget(self.max_staleness, self.items_per_version, lag)
                    - self.consumed_at_version - sum(self.ahead.values()))
        pending = (self.total_reserved + self.prompt_batch_size) * self.samples_per_prompt
        return in_flight + pending <= capacity

    def oldest_allowed_at(self, version: int) -> int:
        """The oldest policy version items trained at ``version`` may have been made at (never
        older than what the trainer's own version allows: ``oldest_allowed_at(trainer_version)``)."""
        return max(version, self.trainer_version) - self.max_staleness

    def reserve(self, maker_id: int, n: int) -> None:
        """``n`` prompts handed to ``maker_id`` (negative: their items came back)."""
        self.reserved[maker_id] += n

    def drop(self, maker_id: int) -> None:
        """``maker_id``'s process died: what it held is lost (the ledger counts and requeues it)."""
        self.reserved[maker_id] = 0

    def trainer_at(self, version: int) -> None:
        """A trainer rank reported (pull) or pushed ``version``; versions never go back."""
        if version > self.trainer_version:
            self.trainer_version = version
            self.consumed_at_version = self.ahead.pop(version, 0)
            self.ahead = {v: n for v, n in self.ahead.items() if v > version}

    def restart(self) -> None:
        """A worker group starts from a checkpoint (``Coordinator.rewind``): what earlier groups
        pulled at the trainer's version or ahead of it was never trained by this one (its prompts
        are served again), so it needs as many items again: a group that died after pulling at
        version V, before pushing V + 1, would otherwise leave a successor at V (its checkpoint's
        version equal to the makers') with no admission left, and the makers would wait forever."""
        self.consumed_at_version = 0
        self.ahead = {}

    def consumed(self, n: int, version: int) -> None:
        """A rank pulled ``n`` items to train at ``version``. A rank still finishing the previous
        version's step (rank 0 already pushed the next one) consumed from that version's budget,
        not from the new version's; a rank pulling ahead, from the later version's."""
        if version > self.trainer_version:
            self.ahead[version] = self.ahead.get(version, 0) + n
        elif version == self.trainer_version:
            self.consumed_at_version += n

    def unconsumed(self, n: int, version: int | None = None) -> None:
        """``n`` pulled items were lost in transit, or handed back untrained (pulled ahead for
        ``version``, a step that did not run): the trainer still needs as many."""
        if version is not None and version in self.ahead:
            left = self.ahead.pop(version) - n
            if left > 0:
                self.ahead[version] = left
        else:
            self.consumed_at_version = max(0, self.consumed_at_version - n)


class MakerBook:
    """Responsibilities: each maker's loaded version, failure and restarts, the times and tokens
    makers report with their batches, and the engine log-prob gaps they measured (the prompt
    counts they report are the ledger's: ``ray_ppo.coordinator.ledger``)."""

    def __init__(self, num_makers: int):
        self.states = {i: MakerStatus() for i in range(num_makers)}  # ``reserved`` is Admission's: left 0 here
        self.logprob_gaps: list[tuple[float, float, int]] = []  # per engine batch: (sum, max, tokens)
        self.tracebacks: dict[int, str] = {}  # a failed maker's own traceback of its error, if it sent one

    def _update(self, maker_id: int, **changes) -> None:
        self.states[maker_id] = dataclasses.replace(self.states[maker_id], **changes)

    def record(self, maker_id: int, stats: MakerStats) -> None:
        s = self.states[maker_id]
        self._update(maker_id, generate_s=s.generate_s + stats.generate_s, idle_s=s.idle_s + stats.idle_s,
                     admission_s=s.admission_s + stats.admission_s, pause_s=s.pause_s + stats.pause_s,
                     tokens=s.tokens + stats.num_tokens, running=stats.running,
                     slot_steps=s.slot_steps + stats.slot_steps, slot_capacity=s.slot_capacity + stats.slot_capacity,
                     kv_kept=s.kv_kept + stats.kv_kept, kv_recomputed=s.kv_recomputed + stats.kv_recomputed)
        if stats.logprob_gap is not None:
            self.logprob_gaps.append(tuple(stats.logprob_gap))

    def loaded(self, maker_id: int, version: int) -> None:
        self._update(maker_id, version=max(self.states[maker_id].version, version))

    def fail(self, maker_id: int, error: str, origin_traceback: str = "") -> None:
        """Record a maker's failure; its first is kept (a maker reports its own exception, and the
        driver reports the same loop's end after it, with less to say)."""
        if self.states[maker_id].failed:
            return
        self._update(maker_id, failed=error)
        self.tracebacks[maker_id] = origin_traceback

    def restarted(self, maker_id: int) -> None:
        """A new process: back to the initial weights until it loads the latest push."""
        self._update(maker_id, version=0, running=0, restarts=self.states[maker_id].restarts + 1)

    def failure(self) -> RuntimeError | None:
        """The first failed maker's error: a ``RuntimeError`` whose message is the run's one-line
        diagnosis and whose ``origin_traceback`` is that maker's own traceback of it (a reward
        function's frames, say: the trainer's traceback of its pull does not hold them;
        ``ray_ppo.outputs.failures`` writes it to ``RUN_DIR/error.log``). None if no maker failed."""
        failed = {i: s.failed for i, s in self.states.items() if s.failed}
        if not failed:
            return None
        maker_id, error = next(iter(failed.items()))
        diagnosis = RuntimeError(f"maker_{maker_id} failed ({len(failed)}/{len(self.states)} makers failed): {error}")
        diagnosis.origin_traceback = self.tracebacks.get(maker_id, "")
        return diagnosis

    def all_at(self, version: int) -> bool:
        """Every maker that has not failed loaded ``version`` (or later)."""
        return all(s.version >= version or s.failed for s in self.states.values())

    def versions(self) -> dict[int, int]:
        return {i: s.version for i, s in self.states.items()}

    def snapshot(self, reserved: dict[int, int]) -> dict[int, MakerStatus]:
        return {i: dataclasses.replace(s, reserved=reserved.get(i, 0)) for i, s in self.states.items()}


@dataclass
class Push:
    """A weight push: its header and the refs of its buckets as rank 0 hands them in (index -> ref)."""

    header: PushHeader
    bucket_refs: dict[int, Any] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return self.header.version


class PushRelay:
    """Responsibilities: keep the latest push (its refs stay alive for makers that restart later)
    and its buckets as they arrive, also those that arrive before their push's start; tell a
    relay whether its push was superseded.

    Rank 0 sends a push's start and its buckets without waiting for them, and the coordinator is
    an async actor: Ray does not promise to run one caller's calls to it in the order they were
    sent. A bucket that ran before its start, were it dropped, would leave the push without it for
    good: no maker would get that version (``weights_in_sync`` = 0 at the end).
    """

    def __init__(self):
        self.latest: Push | None = None
        self.count = 0  # pushes started
        self.early: dict[int, dict[int, Any]] = {}  # version -> buckets that came before its start

    def start(self, header: PushHeader) -> Push:
        """Open push ``header.version`` with the buckets that came ahead of it; older pushes'
        refs are released here."""
        self.latest = Push(header, self.early.pop(header.version, {}))
        self.early = {v: buckets for v, buckets in self.early.items() if v > header.version}
        self.count += 1
        return self.latest

    def add(self, version: int, index: int, ref: Any) -> bool:
        """Bucket ``index`` of push ``version``, kept for its push also if it has not started yet;
        False (ignored) if a newer push started."""
        if self.latest is not None and version < self.latest.version:
            return False
        if self.latest is None or version > self.latest.version:
            self.early.setdefault(version, {})[index] = ref
        else:
            self.latest.bucket_refs[index] = ref
        return True

    def superseded(self, push: Push) -> bool:
        return self.latest is not None and self.latest.version > push.version

    @property
    def last(self) -> LastPush | None:
        return None if self.latest is None else LastPush(self.latest.version, self.latest.header.nbytes)


class Mailbox:
    """Responsibilities: keep what rank 0 sends the driver, in order, for the driver to read from
    where it left off (the driver polls; rank 0 never waits for it)."""

    def __init__(self):
        self.metrics: list[dict] = []
        self.checkpoints: list[tuple[int, Any]] = []  # (step, ray.train.Checkpoint) as Ray Train stored them
        self.evals: list[Any] = []  # EvalReport of each evaluation, in the order they finished


class PullCancelled(Exception):
    """A pull in progress was cancelled (``CoordinatorState.on_cancel_pull`` or ``on_rewind``)."""


@dataclass
class Pull:
    """A pull in progress (``CoordinatorState.on_pull``): its request and the chunks taken so far."""

    request: PullRequest
    out: list[ExperienceChunk] = field(default_factory=list)
    got: int = 0


@dataclass(frozen=True)
class PromptAsk:
    """A maker's ask for prompts (``CoordinatorState.on_ask``), stamped with its restart count: an
    ask that outlives its maker's process is never served."""

    maker_id: int
    restarts: int


class CoordinatorState:
    """Responsibilities: the coordinator's whole state and every rule over it, as one transaction
    per remote call (``on_...``), each leaving the accounting whole: buffers, admission, makers,
    pushes, the prompt ledger and feed, the mailbox, the pulls in progress and the worker group.

    Synchronous and Ray-free: ``ray_ppo.coordinator.actor.Coordinator`` awaits (space, items,
    admission, buckets, I/O) and calls one transaction per call or wake-up. ``may_...`` methods are
    the conditions it waits on.
    """

    def __init__(self, num_ranks: int, num_makers: int, buffer_size: int, max_staleness: int,
                 items_per_version: int, routing: str = "round_robin", prompt_batch_size: int = 16,
                 samples_per_prompt: int = 1, initial_version: int = 0, ledger: PromptLedger | None = None,
                 feed: PromptFeed | None = None, step_items: int = 0, balance: str = "count"):
        self.num_ranks, self.num_makers, self.routing = num_ranks, num_makers, routing
        self.buffers = RankBuffers(num_ranks, buffer_size, step_items, balance)
        self.admission = Admission(num_makers, max_staleness, items_per_version, prompt_batch_size,
                                   samples_per_prompt, initial_version)
        self.book = MakerBook(num_makers)
        self.pushes = PushRelay()
        self.mailbox = Mailbox()
        self.ledger = ledger if ledger is not None else PromptLedger()
        self.feed = feed
        self.maker_ids: list[int] = []  # registered makers (their handles are the actor's)
        self.rank_pids: dict[int, int | None] = {}  # process of each trainer rank, for diagnostics
        self.pulling: set[tuple[int, int | None]] = set()    # (rank, pid) of each pull in progress
        self.cancelled: set[tuple[int, int | None]] = set()  # of those, the ones cancelled
        self.group = 0  # the trainer worker group whose pulls are served (``on_rewind`` starts the next)
        self.finished = False
        self.evals_asked = 0  # evaluations asked for; makers take turns by this count
        self.relays = 0  # relays started; each one's number goes with its calls to the maker

    @classmethod
    def of_config(cls, cfg: Config, initial_version: int = 0, ledger: PromptLedger | None = None,
                  feed: PromptFeed | None = None) -> CoordinatorState:
        """The state of a run of ``cfg``: its ranks (``trainer``), makers and their batches
        (``maker``), staleness bound (``ppo``), routing and buffers (``topology``)."""
        return cls(cfg.trainer.num_workers, cfg.maker.num_makers, cfg.buffer_size, cfg.ppo.max_staleness,
                   cfg.items_per_version, routing=cfg.topology.routing, prompt_batch_size=cfg.maker.batch_size,
                   samples_per_prompt=cfg.maker.samples_per_prompt, initial_version=initial_version,
                   ledger=ledger, feed=feed, step_items=cfg.trainer.train_batch_size, balance=cfg.topology.balance)

    def on_register(self, maker_ids: list[int]) -> None:
        self.maker_ids = sorted(maker_ids)

    # -- prompt data -----------------------------------------------------------------------------
    def prompts_to_read(self) -> Callable[[], list[Prompt | None]] | None:
        """The feed's reader (blocking I/O, for the actor to run off its event loop) until the
        prompts are loaded; None from then on."""
        return None if self.feed.loaded else self.feed.read

    def on_prompts_read(self, prompts: list[Prompt | None]) -> None:
        """The prompt data was read: the feed serves it, the ledger knows its size (and applies the
        resume state)."""
        self.feed.load(prompts)

    # -- prompts ---------------------------------------------------------------------------------
    def on_ask(self, maker_id: int) -> PromptAsk:
        return PromptAsk(maker_id, self.book.states[maker_id].restarts)

    def _outlived(self, ask: PromptAsk) -> bool:
        """The maker restarted since it asked: the caller died with its old process."""
        return self.book.states[ask.maker_id].restarts != ask.restarts

    def may_answer(self, ask: PromptAsk) -> bool:
        """The ask can be answered: with prompts (admitted), or with None (run over, maker restarted)."""
        return self.finished or self._outlived(ask) or self.admitted(ask.maker_id)

    def admitted(self, maker_id: int) -> bool:
        return self.admission.admits(self.book.states[maker_id].version, self.buffers.in_flight)

    def on_admit(self, ask: PromptAsk) -> bool:
        """Reserve a batch for the ask (before the feed is read, so admission counts it at once);
        False when the run is over or the maker restarted."""
        if self.finished or self._outlived(ask):
            return False
        self.admission.reserve(ask.maker_id, self.admission.prompt_batch_size)
        return True

    def on_serve(self, ask: PromptAsk) -> PromptBatch | None:
        """The reserved batch, from the loaded feed; None, its prompts served again, when the maker
        restarted meanwhile (``on_maker_restarted`` counted the reservation as lost)."""
        batch = self.feed.next(ask.maker_id, self.admission.prompt_batch_size)
        if self._outlived(ask):
            self.ledger.give_back(ask.maker_id, batch.ids)
            return None
        return batch

    # -- experience ------------------------------------------------------------------------------
    def on_send(self, maker_id: int, chunk: ExperienceChunk, stats: MakerStats) -> list[int]:
        """A maker sent a batch's items: count them, return the reservation, record its stats and
        its prompts. Returns the ranks they may go to (``on_place`` places them)."""
        self.buffers.accept(chunk.count)
        self.admission.reserve(maker_id, -stats.num_prompts)
        self.book.record(maker_id, stats)
        self.ledger.returned(maker_id, stats.prompt_ids, chunk.item_prompt_ids(), stats.truncated, stats.dropped_ids)
        return receivers(self.routing, maker_id, self.num_makers, self.num_ranks)

    def may_place(self, targets: list[int]) -> bool:
        return self.finished or self.buffers.has_space(targets)

    def on_place(self, rest: ExperienceChunk, targets: list[int]) -> ExperienceChunk:
        """Buffer what fits of ``rest``; returns what did not (all of it once the run finished:
        counted in flight)."""
        return rest if self.finished else self.buffers.route(rest, targets)

    def on_pull(self, request: PullRequest) -> Pull | None:
        """A rank starts a pull; None (refused, nothing taken) when its worker group was replaced."""
        if request.group is not None and request.group != self.group:
            return None
        self.admission.trainer_at(request.trainer_version)
        self.rank_pids[request.rank] = request.pid
        self.pulling.add(request.key)
        return Pull(request)

    def on_pull_attempt(self, pull: Pull) -> bool:
        """Take what the rank's buffer holds for the pull (dropping, and serving again, what became
        too stale); True once it holds its ``n`` items. Raises ``RuntimeError`` with the run's
        diagnosis when a maker failed (``MakerBook.failure``), ``PullCancelled`` when the pull was cancelled."""
        request = pull.request
        if failure := self.book.failure():
            raise failure
        if request.key in self.cancelled:
            raise PullCancelled
        if stale := self.buffers.drop_stale(request.rank, self.admission.oldest_allowed_at(request.version)):
            self.ledger.requeue(stale)
        pull.got += self.buffers.take(request.rank, request.n - pull.got, pull.out)
        return pull.got == request.n

    def on_pull_committed(self, pull: Pull) -> list[ExperienceChunk]:
        """The pull leaves with its items: they are consumed at its version, their prompts trained
        at its step."""
        request = pull.request
        self.buffers.commit(request.n)
        self.admission.consumed(request.n, request.version)
        self.ledger.consumed((pid for chunk in pull.out for pid in chunk.item_prompt_ids()), request.step)
        self._end(pull)
        return pull.out

    def on_pull_abandoned(self, pull: Pull) -> None:
        """The pull gave up (cancelled, failed, timed out): what it took goes back, in order."""
        self.buffers.put_back(pull.request.rank, pull.out)
        pull.out, pull.got = [], 0
        self._end(pull)

    def _end(self, pull: Pull) -> None:
        self.pulling.discard(pull.request.key)
        self.cancelled.discard(pull.request.key)

    def on_cancel_pull(self, rank: int, pid: int | None) -> bool:
        """Cancel the pull of ``rank`` in process ``pid`` if it is in progress; True if it was."""
        if (rank, pid) not in self.pulling:
            return False
        self.cancelled.add((rank, pid))
        return True

    def on_hand_back(self, rank: int, chunks: list[ExperienceChunk], for_version: int) -> None:
        """Chunks pulled ahead, to train at ``for_version``, for a step that did not run: back to the
        head of the rank's buffer, their prompts buffered again."""
        n = self.buffers.handed_back(rank, chunks)
        self.admission.unconsumed(n, for_version)
        self.ledger.unconsumed(pid for chunk in chunks for pid in chunk.item_prompt_ids())

    def on_items_lost(self, lost: ItemsLost) -> None:
        """Pulled items whose payload died with their maker: not consumed; their prompts served again."""
        self.buffers.lost(lost.n)
        self.admission.unconsumed(lost.n, lost.for_version)
        self.ledger.requeue(lost.prompt_ids)

    # -- makers ----------------------------------------------------------------------------------
    def on_maker_restarted(self, maker_id: int) -> Push | None:
        """A maker's new process: what the old one held is lost (counted, served again), its weights
        are the initial ones. Returns the latest push, for the actor to relay to it (None if none)."""
        self.admission.drop(maker_id)
        self.ledger.maker_lost(maker_id)
        self.book.restarted(maker_id)
        return self.pushes.latest if maker_id in self.maker_ids else None

    def on_maker_failed(self, maker_id: int, error: str, origin_traceback: str = "") -> None:
        """The next pull attempt raises the run's diagnosis, with the maker's traceback."""
        self.book.fail(maker_id, error, origin_traceback)

    # -- weights ---------------------------------------------------------------------------------
    def on_push_start(self, header: PushHeader) -> Push:
        self.admission.trainer_at(header.version)
        return self.pushes.start(header)

    def on_push_bucket(self, version: int, index: int, ref: Any) -> bool:
        """Bucket ``index`` of push ``version``; False (ignored) if a newer push started."""
        return self.pushes.add(version, index, ref)

    def on_relay(self) -> int:
        """A relay of a push to one maker starts; returns its number."""
        self.relays += 1
        return self.relays

    def on_relay_ended(self, maker_id: int, push: Push, loaded: bool) -> None:
        if loaded:
            self.book.loaded(maker_id, push.version)

    def on_relay_failed(self, maker_id: int, push: Push, error: str) -> None:
        self.book.fail(maker_id, f"weight push v{push.version} failed: {error}")

    def superseded(self, push: Push) -> bool:
        """A newer push started: relays of ``push`` stop."""
        return self.pushes.superseded(push)

    def may_relay_bucket(self, push: Push, index: int) -> bool:
        """Bucket ``index`` of ``push`` arrived, or a newer push started."""
        return index in push.bucket_refs or self.pushes.superseded(push)

    def bucket(self, push: Push, index: int) -> Any | None:
        """The ref of bucket ``index`` of ``push`` for a relay to pass on; None once a newer push started."""
        return None if self.pushes.superseded(push) else push.bucket_refs[index]

    # -- evaluation ------------------------------------------------------------------------------
    def on_eval_request(self, step: int, version: int) -> int | None:
        """The live maker whose turn it is to evaluate; None (the failure reported) when none lives."""
        live = [i for i in self.maker_ids if not self.book.states[i].failed]
        self.evals_asked += 1
        if not live:
            self.mailbox.evals.append(EvalReport(step=step, policy_version=version, error="no live maker to evaluate"))
            return None
        return live[(self.evals_asked - 1) % len(live)]

    def on_eval_report(self, report: EvalReport) -> None:
        self.mailbox.evals.append(report)

    # -- what rank 0 hands the driver ------------------------------------------------------------
    def on_metrics(self, row: dict) -> None:
        """Rank 0's metrics row of a step."""
        self.mailbox.metrics.append(row)

    def on_checkpoint_saved(self, step: int, checkpoint: Any) -> None:
        """Ray Train stored rank 0's checkpoint of ``step``."""
        self.mailbox.checkpoints.append((step, checkpoint))

    def metrics_since(self, index: int) -> list[dict]:
        return self.mailbox.metrics[index:]

    def checkpoints_since(self, index: int) -> list[tuple[int, Any]]:
        return self.mailbox.checkpoints[index:]

    def evals_since(self, index: int) -> list[EvalReport]:
        return self.mailbox.evals[index:]

    # -- the run ---------------------------------------------------------------------------------
    def on_rewind(self, step: int) -> int:
        """A worker group starts (also a run's first) from the checkpoint of ``step``: prompts
        trained after it are served again. Pulls of earlier groups belong to processes that died
        (the new group pulls only after this): had they taken items for a dead caller, a step the
        new group redoes would count them as trained, so those in progress are cancelled (they put
        their items back), and those still on their way are refused (``on_pull``: an old group
        number). Returns the new group's number."""
        self.ledger.rewind(step)
        self.cancelled |= self.pulling
        self.admission.restart()  # nothing the dead group pulled was trained by the new one
        self.group += 1
        return self.group

    def on_finish(self) -> None:
        """Makers get no more prompts; sends waiting for space return."""
        self.finished = True

    def counters(self, step: int | None = None) -> Counters:
        """Item counts (this coordinator's) and prompt counts (the run's, from the ledger, which a
        resumed run carries on); ``prompts_trained`` counts prompts trained at steps up to ``step``."""
        b, counts = self.buffers, self.ledger.counts
        return Counters(produced=b.produced, consumed=b.consumed, discarded=b.discarded, lost=counts["lost"],
                        lost_in_transit=b.lost_in_transit, in_flight=b.in_flight,
                        prompts_served=counts["taken"], blank_prompts=counts["blank"], dropped_prompts=counts["dropped"],
                        truncated_prompts=counts["truncated"], epochs=self.feed.epochs if self.feed else 0,
                        prompts_trained=self.ledger.trained_by(step), prompts_requeued=counts["requeued"])

    def first_prompt(self) -> Prompt | None:
        return self.feed.first_prompt if self.feed else None

    def data_state(self, step: int | None = None) -> dict:
        """Where a run resumed from the checkpoint of ``step`` continues the prompt stream."""
        return {**self.ledger.state(step), "first_prompt": self.first_prompt()}

    def status(self, step: int | None = None, node_id: str | None = None) -> CoordinatorStatus:
        return CoordinatorStatus(
            counters=self.counters(step), trainer_version=self.admission.trainer_version,
            data={**self.ledger.summary(), "first_prompt": self.first_prompt()},
            buffered=tuple(self.buffers.buffered(r) for r in range(self.num_ranks)),
            makers=self.book.snapshot(self.admission.reserved), pushes=self.pushes.count,
            last_push=self.pushes.last, rank_pids=dict(self.rank_pids), node_id=node_id)

"""The typed messages that cross a process boundary between the run's actors.

Every call between maker, coordinator, trainer ranks and driver passes one of these frozen
dataclasses (or an ``ExperienceChunk``, ``ray_ppo.wire.transport``), never a loose dict, so a misspelt
field fails where it is written instead of silently reading as zero.

  - ``PromptBatch``    coordinator -> maker: the prompts of one work item (each a ``Prompt``);
  - ``MakerStats``     maker -> coordinator: what making one batch cost and skipped;
  - ``PullRequest``    trainer rank -> coordinator: items for a step; ``PullReply`` the answer;
  - ``ItemsLost``      trainer rank -> coordinator: pulled items whose payload died with their maker;
  - ``PushHeader``     trainer rank 0 -> coordinator -> maker: what a weight push carries besides
                       its buckets;
  - ``CoordinatorStatus`` coordinator -> trainer rank 0 and driver: counters, versions, maker states;
  - ``EvalReport``     maker -> coordinator -> trainer rank 0: one held-out evaluation of the weights
                       of a step (``eval`` section);
  - ``RunHandles``     driver -> trainer ranks and makers: where to find the run's coordinator.

``kl_coef`` has one owner: the trainer's KL controller (``ray_ppo.algo.make_kl_controller``),
which ``ppo.kl_coef`` only seeds. Its current value reaches the makers in the ``PushHeader`` of
every weight push; a maker shapes rewards with the value that came with the weights it holds
(swapped in together, so items tagged policy version v were shaped with version v's
coefficient), and with ``ppo.kl_coef`` until its first push. The local loop, which has no
pushes, passes the controller's value to ``ExperienceMaker.make_experience`` directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ray_ppo.data import Prompt  # noqa: F401  (a prompt as the data gives it; ``ray_ppo.data`` reads and checks them)
from ray_ppo.outputs.evals import EvalReport  # noqa: F401  (made by ``ray_ppo.makers.evaluation``, which the local loop runs too)


@dataclass(frozen=True)
class PromptBatch:
    """Work item for a maker: prompts as the data gave them (``Prompt``; None for a missing one);
    encoding happens in the maker."""

    prompts: list[Prompt | None]
    ids: list[int] = field(default_factory=list)
    """Prompt id of each prompt (``ray_ppo.coordinator.ledger``); the maker tags the items it makes with them."""


@dataclass(frozen=True)
class MakerStats:
    """What a maker reports with each batch it sends (``Coordinator.send``)."""

    num_prompts: int = 0
    """Prompts of the batch, blank ones included (their reservation is returned)."""
    prompt_ids: tuple[int, ...] = ()
    """Every prompt id of the batch; ids without items count as blank (``ray_ppo.coordinator.ledger``)."""
    blank: int = 0
    """Prompts skipped because they were empty."""
    dropped_ids: tuple[int, ...] = ()
    """Of ``prompt_ids``, those whose group ``algo.dynamic_sampling`` dropped (rewards all equal): consumed, no items."""
    truncated: int = 0
    """Prompts cut to ``data.max_prompt_len`` tokens."""
    num_tokens: int = 0
    """Response tokens generated."""
    generate_s: float = 0.0
    """Seconds generating and scoring the batch."""
    idle_s: float = 0.0
    """Seconds waiting since the previous batch: for prompts (admission) and for the sender (back-pressure)."""
    admission_s: float = 0.0
    """Of ``idle_s``: the wait for this prompt batch (admission control)."""
    pause_s: float = 0.0
    """Seconds generation was paused for weight swaps since the previous batch."""
    logprob_gap: tuple[float, float, int] | None = None
    """With an inference engine: (sum, max, tokens) of |engine - HF| log-probs of the sampled tokens."""
    running: int = 0
    """Streaming makers (``maker.max_running``): the sequences running at the send."""
    slot_steps: int = 0
    """Streaming makers: decode steps times the sequences each ran, since the previous send."""
    slot_capacity: int = 0
    """Streaming makers: decode steps times ``maker.max_running``, since the previous send."""
    kv_kept: int = 0
    """Streaming makers: running sequences whose cache a weight swap kept (``maker.kv_at_swap``), since the previous send."""
    kv_recomputed: int = 0
    """Streaming makers: running sequences whose cache a weight swap recomputed, since the previous send."""


@dataclass(frozen=True, kw_only=True)
class PullRequest:
    """``n`` items for trainer rank ``rank`` (``Coordinator.pull``); built with keywords only."""

    rank: int
    n: int
    trainer_version: int
    """The rank's policy version now."""
    timeout_s: float
    """How long the coordinator waits for items before it answers with its stall diagnosis."""
    pid: int | None = None
    """The rank's process: a cancel (``cancel_pull``) names the pull by (rank, pid)."""
    step: int | None = None
    """The step the items are trained at (their prompts count as trained at it)."""
    for_version: int | None = None
    """The version the items train at, when later than ``trainer_version`` (a pull ahead)."""
    group: int | None = None
    """The worker group the rank belongs to (``Coordinator.rewind``'s number); a replaced group's
    pull is refused."""

    @property
    def version(self) -> int:
        """The policy version the pulled items are trained at."""
        return self.trainer_version if self.for_version is None else self.for_version

    @property
    def key(self) -> tuple[int, int | None]:
        return self.rank, self.pid


class PullOutcome(enum.Enum):
    """How a pull ended (``PullReply.outcome``)."""

    PULLED = "pulled"
    """It brought its ``n`` items."""
    CANCELLED = "cancelled"
    """It was cancelled while it waited (``cancel_pull``, or a rewind): nothing."""
    REPLACED = "replaced"
    """It came from a worker group a rewind replaced: refused, nothing."""


@dataclass(frozen=True)
class PullReply:
    """What a pull brought: ``chunks`` holding its ``n`` items (``outcome`` ``PullOutcome.PULLED``),
    or nothing (``CANCELLED``, ``REPLACED``)."""

    chunks: list = field(default_factory=list)
    """``ray_ppo.wire.transport.ExperienceChunk``s; ``resolve`` fetches their items."""
    outcome: PullOutcome = PullOutcome.PULLED

    @property
    def pulled(self) -> bool:
        return self.outcome is PullOutcome.PULLED


@dataclass(frozen=True)
class ItemsLost:
    """Rank ``rank`` pulled ``n`` items, to train at ``for_version``, whose payload died with their
    maker (``Coordinator.lost_in_transit``): not consumed after all; their prompts are served again."""

    rank: int
    n: int
    prompt_ids: tuple[int, ...] = ()
    """One per lost item."""
    for_version: int | None = None


@dataclass(frozen=True)
class PushHeader:
    """A weight push, apart from its buckets: sent at chunk_start (``weights_start``)."""

    version: int
    """Policy version of the pushed weights."""
    num_chunks: int
    """Buckets that follow (``weights_chunk``), indices 0 .. num_chunks - 1."""
    nbytes: int
    """Bytes of all buckets together."""
    kl_coef: float
    """The trainer's KL coefficient when it pushed (its KL controller's value): the maker shapes
    the rewards of items made with these weights with it."""
    partial: bool = False
    """LoRA-only push (``sync.lora_only``): adapters and value head; the rest is the maker's own."""


@dataclass(frozen=True)
class Counters:
    """Item and prompt accounting. At any time: produced = consumed + in_flight + discarded + lost_in_transit.

    The item counts are the coordinator's, since it started (a resumed run's start from zero); the
    prompt counts are the run's, from its prompt ledger (``ray_ppo.coordinator.ledger``), which a
    resumed run restores from its checkpoint."""

    produced: int = 0
    """Items makers handed to ``send``."""
    consumed: int = 0
    """Items returned to trainer ranks by ``pull`` (less those lost in transit)."""
    discarded: int = 0
    """Items dropped because they exceeded ``max_staleness``."""
    lost: int = 0
    """Prompts taken for a maker that died before sending their items."""
    lost_in_transit: int = 0
    """Items sent by a maker that died before a rank fetched them."""
    in_flight: int = 0
    """Items buffered or waiting for buffer space."""
    prompts_served: int = 0
    """Prompts handed to makers."""
    blank_prompts: int = 0
    """Prompts skipped because they were empty."""
    dropped_prompts: int = 0
    """Prompts whose group ``algo.dynamic_sampling`` dropped (rewards all equal): drawn beyond those trained."""
    truncated_prompts: int = 0
    """Prompts cut to ``data.max_prompt_len`` tokens."""
    epochs: int = 0
    """Full passes over the prompt dataset started."""
    prompts_trained: int = 0
    """Prompts all of whose items were pulled for a step (each counted once), at steps up to the
    step asked for (``Coordinator.status(step)``), else at any step so far."""
    prompts_requeued: int = 0
    """Prompts served again: items discarded, lost, or trained in redone steps."""


@dataclass(frozen=True)
class MakerStatus:
    """One maker as the coordinator sees it; times and tokens are totals since the run started."""

    version: int = 0
    """Policy version of the weights it loaded last."""
    failed: str | None = None
    """Why it failed, or None."""
    generate_s: float = 0.0
    idle_s: float = 0.0
    admission_s: float = 0.0
    """Of ``idle_s``: waiting for prompts (admission control); the rest is back-pressure."""
    pause_s: float = 0.0
    """Generation paused for weight swaps."""
    tokens: int = 0
    running: int = 0
    """Streaming makers: the sequences running at its last send."""
    slot_steps: int = 0
    """Streaming makers: decode steps times the sequences each ran."""
    slot_capacity: int = 0
    """Streaming makers: decode steps times ``maker.max_running`` (``slot_steps / slot_capacity``: slot utilisation)."""
    kv_kept: int = 0
    """Streaming makers: running sequences whose cache a weight swap kept."""
    kv_recomputed: int = 0
    """Streaming makers: running sequences whose cache a weight swap recomputed."""
    reserved: int = 0
    """Prompts handed out whose items have not come back."""
    restarts: int = 0


@dataclass(frozen=True)
class LastPush:
    """The latest weight push the coordinator relayed."""

    version: int
    nbytes: int


@dataclass(frozen=True)
class CoordinatorStatus:
    """A snapshot of the coordinator (``Coordinator.status``): small and of fixed size, so rank 0
    can ask for it at every step."""

    counters: Counters
    trainer_version: int
    """The highest policy version a trainer rank reported (pull) or pushed."""
    data: dict
    """Where the prompt stream stands (``PromptLedger.summary``) and ``first_prompt``, the first
    prompt served (a ``Prompt``: where a resumed run restarted)."""
    buffered: tuple[int, ...]
    """Items in each rank's buffer."""
    makers: dict[int, MakerStatus]
    pushes: int = 0
    """Weight pushes started."""
    last_push: LastPush | None = None
    rank_pids: dict[int, int | None] = field(default_factory=dict)
    """Process id of each trainer rank (from its last pull), for diagnostics."""
    node_id: str | None = None
    """The Ray node the coordinator runs on."""


@dataclass(frozen=True)
class RunHandles:
    """Where a process finds the run's coordinator: its name and namespace, not its handle.

    A maker is a detached actor with ``max_restarts``. Ray keeps an actor's constructor arguments
    in the object store, owned by the driver, when an actor handle is among them, and cannot
    restart the actor once they are gone (ray-project/ray#53727), e.g. after the driver exited.
    Plain strings are inlined in the actor's creation task, so a restart needs nothing the driver
    owns: the new process looks the coordinator up again."""

    namespace: str
    coordinator_name: str = "coordinator"

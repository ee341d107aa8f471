"""The coordinator's exactly-once identities, on ``CoordinatorState`` alone: random sequences of its
transactions (asks, sends, placements, pulls that finish, wait, time out or are cancelled, pulls
ahead handed back, items lost in transit, pushes, maker restarts and failures, worker-group
rewinds), with no asyncio and no Ray. After every transaction:

  - items: produced = consumed + in_flight + discarded + lost_in_transit, and the items in flight
    are exactly those in the buffers, waiting for space, or taken by a pull still in progress;
  - prompts: every prompt ever served is in exactly one place (at a maker, buffered, waiting to be
    served again, blank, or trained), no prompt is trained twice, and a buffered prompt's count is
    the number of its items in flight;
  - admission: each maker's reservation is what it holds, and no budget goes negative.

The model below plays the makers and the trainer ranks as the actor's callers would.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field

import pytest

from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.coordinator.state import CoordinatorState, Pull, PullCancelled
from ray_ppo.wire.messages import ItemsLost, MakerStats, PullRequest, PushHeader
from ray_ppo.wire.transport import ExperienceChunk
from tests.unit.test_coordinator import item

NUM_PROMPTS = 1000  # more than a sequence serves: no epoch completes, so the trained log is never pruned
NUM_RANKS, NUM_MAKERS, BATCH = 2, 2, 2


@dataclass
class Held:
    """A prompt batch a maker holds, with the version it will generate at."""

    maker_id: int
    ids: list[int]
    version: int


@dataclass
class Model:
    """What the callers hold: makers' batches, sends waiting for space, pulls in progress, and pulls
    a rank holds (trained at a step, or pulled ahead for one)."""

    state: CoordinatorState
    group_size: int
    rng: random.Random
    version: int = 0
    step: int = 0
    served: set[int] = field(default_factory=set)
    blank: set[int] = field(default_factory=set)
    held: list[Held] = field(default_factory=list)
    waiting: list[tuple[ExperienceChunk, list[int]]] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    pulled: list[Pull] = field(default_factory=list)
    pid: int = 100

    # -- the callers' moves ------------------------------------------------------------------
    def ask(self) -> None:
        s, maker_id = self.state, self.rng.randrange(NUM_MAKERS)
        ask = s.on_ask(maker_id)
        if not s.may_answer(ask) or not s.on_admit(ask):
            return
        if self.rng.random() < 0.1:  # the maker restarts while its batch is read
            self.restart(maker_id)
        batch = s.on_serve(ask)
        if batch is not None:
            self.served.update(batch.ids)
            self.held.append(Held(maker_id, list(batch.ids), s.book.states[maker_id].version))

    def send(self) -> None:
        if not self.held:
            return
        h = self.held.pop(self.rng.randrange(len(self.held)))
        made = []
        for pid in h.ids:
            if self.rng.random() < 0.1:
                self.blank.add(pid)  # a blank prompt: no items
                continue
            for k in range(self.group_size):
                it = item(h.version, f"p{pid}-{k}")
                it.prompt_id = pid
                made.append(it)
        chunk = ExperienceChunk.of(made, "inline", self.group_size)
        targets = self.state.on_send(h.maker_id, chunk, MakerStats(num_prompts=len(h.ids), prompt_ids=tuple(h.ids)))
        self.waiting.append((chunk, targets))
        self.place()

    def place(self) -> None:
        still = []
        for rest, targets in self.waiting:
            if rest.count and self.state.may_place(targets):
                rest = self.state.on_place(rest, targets)
            if rest.count:
                still.append((rest, targets))
        self.waiting = still

    def pull(self) -> None:
        ahead = self.rng.random() < 0.3
        self.pid += 1
        request = PullRequest(rank=self.rng.randrange(NUM_RANKS), n=self.group_size * self.rng.randint(1, 3),
                              trainer_version=self.version, timeout_s=1.0, pid=self.pid,
                              step=self.step + (2 if ahead else 1),
                              for_version=self.version + 1 if ahead else None, group=self.state.group)
        pull = self.state.on_pull(request)
        assert pull is not None  # the live group's pull is always served
        self.pulls.append(pull)
        self.attempt(pull)

    def attempt(self, pull: Pull) -> None:
        try:
            done = self.state.on_pull_attempt(pull)
        except PullCancelled:
            self.state.on_pull_abandoned(pull)
            self.pulls.remove(pull)
            return
        if done:
            self.state.on_pull_committed(pull)
            self.pulls.remove(pull)
            self.pulled.append(pull)

    def retry_or_give_up(self) -> None:
        if not self.pulls:
            return
        pull = self.rng.choice(self.pulls)
        move = self.rng.choice(["attempt", "timeout", "cancel"])
        if move == "attempt":
            self.attempt(pull)
        elif move == "timeout":
            self.state.on_pull_abandoned(pull)
            self.pulls.remove(pull)
        else:
            assert self.state.on_cancel_pull(*pull.request.key)
            self.attempt(pull)
            assert pull not in self.pulls

    def finish_pulled(self) -> None:
        """A rank trains what it pulled (the step advances), hands back a pull ahead for a step that
        will not run, or finds a pull's payload died with its maker."""
        if not self.pulled:
            return
        pull = self.pulled.pop(self.rng.randrange(len(self.pulled)))
        move = self.rng.choice(["train", "train", "hand_back", "lost"])
        if move == "hand_back":
            self.state.on_hand_back(pull.request.rank, pull.out, pull.request.version)
        elif move == "lost":
            ids = tuple(pid for chunk in pull.out for pid in chunk.item_prompt_ids())
            self.state.on_items_lost(ItemsLost(pull.request.rank, len(ids), ids, pull.request.version))
        else:
            self.step = max(self.step, pull.request.step)

    def push(self) -> None:
        self.version += 1
        push = self.state.on_push_start(PushHeader(self.version, 1, 8, kl_coef=0.0))
        for maker_id in range(NUM_MAKERS):
            if self.rng.random() < 0.8:
                self.state.on_relay_ended(maker_id, push, loaded=True)

    def restart(self, maker_id: int | None = None) -> None:
        maker_id = self.rng.randrange(NUM_MAKERS) if maker_id is None else maker_id
        push = self.state.on_maker_restarted(maker_id)
        self.held = [h for h in self.held if h.maker_id != maker_id]  # died with the old process
        if push is not None:
            self.state.on_relay_ended(maker_id, push, loaded=True)

    def rewind(self) -> None:
        """The worker group dies; the next one starts from the checkpoint of an earlier step. What
        the dead group held dies with it; its pulls in progress end cancelled."""
        checkpoint = self.rng.randint(max(0, self.step - 2), self.step)
        self.state.on_rewind(checkpoint)
        self.pulled.clear()
        for pull in list(self.pulls):
            self.attempt(pull)
        assert not self.pulls
        self.step = checkpoint

    # -- what must hold ----------------------------------------------------------------------
    def check(self) -> None:
        s, b, ledger = self.state, self.state.buffers, self.state.ledger
        assert b.produced == b.consumed + b.in_flight + b.discarded + b.lost_in_transit
        places = [chunk for queue in b.queues for chunk in queue]
        places += [rest for rest, _ in self.waiting] + [chunk for pull in self.pulls for chunk in pull.out]
        assert b.in_flight == sum(chunk.count for chunk in places)

        items_of = collections.Counter(pid for chunk in places for pid in chunk.item_prompt_ids())
        assert ledger.buffered == dict(items_of)

        trained = [pid for ids in ledger.log.values() for pid in ids]
        assert len(trained) == len(set(trained)), "a prompt trained twice"
        where = {"at a maker": {pid for ids in ledger.at_maker.values() for pid in ids},
                 "buffered": set(ledger.buffered), "to serve again": set(ledger.retry),
                 "blank": self.blank, "trained": set(trained)}
        for pid in self.served:
            found = [name for name, ids in where.items() if pid in ids]
            assert len(found) == 1, f"prompt {pid} is {found or 'nowhere'}"
        assert len(ledger.retry) == len(set(ledger.retry))

        for maker_id in range(NUM_MAKERS):
            held = sum(len(h.ids) for h in self.held if h.maker_id == maker_id)
            assert s.admission.reserved[maker_id] == held
            assert ledger.at_maker.get(maker_id, set()) == {pid for h in self.held if h.maker_id == maker_id for pid in h.ids}
        assert s.admission.consumed_at_version >= 0 and all(n > 0 for n in s.admission.ahead.values())


def new_model(seed: int, group_size: int) -> Model:
    ledger = PromptLedger(shuffle=True, seed=seed)
    feed = PromptFeed(lambda: [f"q{i}" for i in range(NUM_PROMPTS)], ledger)
    feed.load(feed.read())
    state = CoordinatorState(NUM_RANKS, NUM_MAKERS, buffer_size=4 * group_size, max_staleness=2,
                             items_per_version=4 * group_size, prompt_batch_size=BATCH,
                             samples_per_prompt=group_size, ledger=ledger, feed=feed)
    state.on_register(list(range(NUM_MAKERS)))
    return Model(state, group_size, random.Random(seed))


MOVES = {"ask": 12, "send": 10, "place": 6, "pull": 8, "retry_or_give_up": 6, "finish_pulled": 8,
         "push": 1, "restart": 1, "rewind": 1}


@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("seed", range(10))
def test_the_exactly_once_identities_hold_through_any_sequence(seed, group_size):
    model = new_model(seed, group_size)
    names, weights = list(MOVES), list(MOVES.values())
    done, trained = collections.Counter(), 0
    for i in range(600):
        move = model.rng.choices(names, weights)[0]
        getattr(model, move)()
        done[move] += 1
        try:
            model.check()
        except AssertionError as e:
            raise AssertionError(f"after move {i} ({move}), seed {seed}: {e}") from None
        trained = max(trained, model.state.ledger.trained_by())
    # the sequences reach every kind of move, and prompts do get trained (a rewind may undo them)
    assert set(done) == set(MOVES), done
    assert trained >= 10, trained


def test_a_failed_maker_fails_the_next_pull_attempt_and_its_items_go_back():
    model = new_model(0, 1)
    for _ in range(3):
        model.ask()
    while model.held:
        model.send()
    model.state.on_maker_failed(1, "CUDA error")
    pull = model.state.on_pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=1.0, pid=7, step=1))
    with pytest.raises(RuntimeError, match="maker_1 failed .*CUDA error"):
        model.state.on_pull_attempt(pull)
    buffered = model.state.buffers.buffered(0)
    model.state.on_pull_abandoned(pull)
    assert model.state.buffers.buffered(0) == buffered and not model.state.pulling
    model.check()


def test_a_replaced_groups_pull_is_refused_and_takes_nothing():
    model = new_model(1, 1)
    model.ask()
    model.send()
    old = model.state.group
    model.state.on_rewind(0)
    assert model.state.on_pull(PullRequest(rank=0, n=1, trainer_version=0, timeout_s=1.0, group=old)) is None
    assert not model.state.pulling and model.state.buffers.pulled == 0
    model.check()

"""Which prompts are done, by identity: every prompt of an epoch is trained on exactly once,
across any number of crashes and resumes and with any number of makers.

Identity. The run's prompt stream is a function of (number of prompts N, ``data.shuffle``,
``seed``) alone: epoch e serves the dataset's rows in ``order(e)`` (``ray_ppo.data.seeds.prompt_order``:
a permutation seeded by seed + e, or file order; the synchronous loop serves the same). The s-th
prompt served (its *serial*) has the *prompt id* ``e * N + row`` with e = s // N and
row = order(e)[s % N]. Items carry the prompt id of the prompt they answer, so several items
(``samples_per_prompt`` > 1) may share one.

Life of a prompt: *taken* for a maker -> the maker returns its batch: no item (a blank prompt, or
a group ``algo.dynamic_sampling`` dropped: done) or items, *buffered* by the coordinator -> a
rank *pulls* the items for a step: once all of
a prompt's items are pulled it is *trained* at that step (done). A prompt whose items are
discarded as stale, die with a maker (held by it, or sent by reference and gone), or were
pulled for steps that a restarted worker group redoes (``rewind``) is *requeued*: served again,
before any new prompt. So "exactly once" counts trainings that survive into the final weights.

A checkpoint at step s stores the *watermark* (the first serial not done at step s), ``next``
(the first serial never taken) and the ids done in between. A resumed run serves the not-done
prompts between them first (in serial order), then continues at ``next``; prompts that were in
flight when the run stopped are among them.

The per-step log of trained prompt ids (``trained``, kept in the checkpoint for the current and
the previous epoch) makes this checkable from the outside: every id appears in it once.

Counts. The ledger keeps the run's prompt counts (``counts``: taken, blank, dropped, truncated,
lost, requeued) and the prompts trained at each step (``trained_by``), which the run's metrics report.
A checkpoint at step s stores them (``counts``, with ``trained`` = the prompts trained at steps up
to s), so a resumed run's counts go on from the run's, not from zero.

``PromptLedger`` is a plain class (no Ray, no asyncio); the coordinator owns one.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

from ray_ppo.data.seeds import prompt_order

LOG_EPOCHS = 2
"""Epochs of the per-step log kept (the watermark's epoch and the one before)."""

COUNTS = ("taken", "blank", "dropped", "truncated", "lost", "requeued")
"""The ledger's running prompt counts: handed to makers; of them, with no item (blank, or dropped
by dynamic sampling), cut to
``data.max_prompt_len`` tokens, taken for a maker that died before sending their items (lost);
and served again (requeued)."""


class LedgerError(ValueError):
    """A resume state that does not fit the prompt data."""


class PromptLedger:
    """Responsibilities: hand out prompt ids in stream order (requeued ones first), follow each
    to done, requeue what was not trained, and save/restore all of it at a checkpoint."""

    def __init__(self, shuffle: bool = False, seed: int = 0, start: dict | None = None):
        """``start``: a checkpoint's ``state()``; its stream (shuffle, seed) wins over the arguments,
        so a resumed run keeps its prompt order whatever ``data.shuffle`` / ``seed`` say now."""
        start = start or None
        self.shuffle = bool(start.get("shuffle", shuffle)) if start else shuffle
        self.seed = int(start.get("seed", seed)) if start else seed
        self.start = start
        self.num_prompts: int | None = None  # known once the prompts are loaded (``configure``)
        self.next_serial = 0
        self.watermark = 0                      # first serial not done
        self.done: set[int] = set()             # done ids with serial in [watermark, next_serial)
        self.retry: collections.deque[int] = collections.deque()  # ids to serve again, first
        self.at_maker: dict[int, set[int]] = collections.defaultdict(set)
        self.buffered: dict[int, int] = {}      # id -> its items in the coordinator's buffers
        self.log: dict[int, list[int]] = {}     # step -> ids trained at that step
        counts = start.get("counts", {}) if start else {}  # the run's counts at the checkpoint
        self.counts = {key: int(counts.get(key, 0)) for key in COUNTS}
        self.trained_before = int(counts.get("trained", 0))  # prompts trained up to the checkpoint
        self.trained_at: collections.Counter[int] = collections.Counter()  # step -> prompts this ledger trained at it
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # -- the stream ------------------------------------------------------------------------------
    def configure(self, num_prompts: int) -> None:
        """Set the number of prompts (rows of the dataset) and apply the resume state, if any."""
        if num_prompts <= 0:
            raise LedgerError("the prompt dataset is empty")
        self.num_prompts = num_prompts
        if self.start:
            self._restore(self.start)

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows in serving order, position of each row) of ``epoch``."""
        if epoch not in self._orders:
            n = self.num_prompts
            order = prompt_order(n, self.seed, epoch, self.shuffle)
            inverse = np.empty(n, dtype=np.int64)
            inverse[order] = np.arange(n)
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (order, inverse)
        return self._orders[epoch]

    def prompt_id(self, serial: int) -> int:
        epoch, position = divmod(serial, self.num_prompts)
        return epoch * self.num_prompts + int(self._order(epoch)[0][position])

    def serial(self, prompt_id: int) -> int:
        epoch, row = divmod(prompt_id, self.num_prompts)
        return epoch * self.num_prompts + int(self._order(epoch)[1][row])

    def row(self, prompt_id: int) -> int:
        """The dataset row of a prompt id."""
        return prompt_id % self.num_prompts

    @property
    def epoch(self) -> int:
        """The epoch of the next new prompt."""
        return self.next_serial // self.num_prompts if self.num_prompts else 0

    # -- events ----------------------------------------------------------------------------------
    def take(self, n: int, maker_id: int) -> list[int]:
        """Up to ``n`` ids for ``maker_id``: requeued ones first, then new ones."""
        ids = [self.retry.popleft() for _ in range(min(n, len(self.retry)))]
        while len(ids) < n:
            ids.append(self.prompt_id(self.next_serial))
            self.next_serial += 1
        self.at_maker[maker_id].update(ids)
        self.counts["taken"] += len(ids)
        return ids

    def returned(self, maker_id: int, batch_ids: Sequence[int], item_ids: Iterable[int], truncated: int = 0,
                 dropped: Iterable[int] = ()) -> None:
        """A maker sent its batch (``truncated`` of its prompts cut to ``data.max_prompt_len``
        tokens): ids with no item were blank, or ``dropped`` (dynamic sampling), and are done; the
        others are buffered."""
        self.counts["truncated"] += truncated
        per_prompt = collections.Counter(int(i) for i in item_ids)
        dropped = {int(i) for i in dropped}
        held = self.at_maker[maker_id]
        for pid in batch_ids:
            if pid not in held:  # requeued meanwhile (its maker was declared lost)
                continue
            held.discard(pid)
            if per_prompt[pid]:
                self.buffered[pid] = self.buffered.get(pid, 0) + per_prompt[pid]
            else:
                self.counts["dropped" if pid in dropped else "blank"] += 1
                self._mark_done(pid)

    def consumed(self, item_ids: Iterable[int], step: int | None) -> int:
        """A rank pulled these items for ``step``; returns how many prompts became trained."""
        step = step if step is not None else -1
        trained = 0
        for pid in (int(i) for i in item_ids):
            if pid not in self.buffered:
                continue  # not from this ledger's stream (tests), or requeued meanwhile
            self.buffered[pid] -= 1
            if self.buffered[pid] == 0:
                del self.buffered[pid]
                self.log.setdefault(step, []).append(pid)
                self._mark_done(pid)
                trained += 1
        self.trained_at[step] += trained
        return trained

    def trained_by(self, step: int | None = None) -> int:
        """Prompts of the run trained at steps up to ``step`` (all so far when None), each once.
        A rank pulls the next step's items while a step trains (``trainer.prefetch``): those are
        trained at the next step, so a step's metrics row counts them only from that step on."""
        return self.trained_before + sum(n for s, n in self.trained_at.items() if step is None or s <= step)

    def unconsumed(self, item_ids: Iterable[int]) -> None:
        """Pulled items handed back untrained (a rank pulled them ahead for a step that did not
        run): buffered again, and a prompt they had completed is no longer trained."""
        for pid in (int(i) for i in item_ids):
            if pid in self.buffered:
                self.buffered[pid] += 1
            elif self._undo_trained(pid):
                self.buffered[pid] = 1

    def requeue(self, item_ids: Iterable[int]) -> int:
        """Items discarded (stale) or lost in transit: their prompts are served again. Returns
        how many prompts were requeued."""
        requeued = 0
        for pid in dict.fromkeys(int(i) for i in item_ids):
            if pid in self.buffered:
                del self.buffered[pid]
            elif not self._undo_trained(pid):
                continue
            self.retry.append(pid)
            requeued += 1
        self.counts["requeued"] += requeued
        return requeued

    def give_back(self, maker_id: int, ids: Sequence[int]) -> int:
        """Ids taken for a maker that never got them (it restarted meanwhile): served again."""
        held = self.at_maker[maker_id]
        back = [pid for pid in ids if pid in held]
        held.difference_update(back)
        self.retry.extend(back)
        self.counts["lost"] += len(back)
        self.counts["requeued"] += len(back)
        return len(back)

    def maker_lost(self, maker_id: int) -> int:
        """A maker's process died: the prompts it held are served again."""
        ids = sorted(self.at_maker.pop(maker_id, ()), key=self.serial)
        self.retry.extend(ids)
        self.counts["lost"] += len(ids)
        self.counts["requeued"] += len(ids)
        return len(ids)

    def rewind(self, step: int) -> int:
        """A worker group restarted from the checkpoint of ``step``: prompts trained after it are
        served again (the weights that learned from them were thrown away)."""
        ids = [pid for s in sorted(self.log) if s > step for pid in self.log[s]]
        for pid in ids:
            self._undo_trained(pid)
        self.retry.extendleft(reversed(ids))
        self.counts["requeued"] += len(ids)
        return len(ids)

    # -- done and undone -------------------------------------------------------------------------
    def _mark_done(self, pid: int) -> None:
        self.done.add(pid)
        epoch = self.watermark // self.num_prompts
        while self.watermark < self.next_serial and (first := self.prompt_id(self.watermark)) in self.done:
            self.done.discard(first)
            self.watermark += 1
        if self.watermark // self.num_prompts != epoch:  # an epoch completed: the log can shrink
            self._prune_log()

    def _undo_trained(self, pid: int) -> bool:
        """Forget that ``pid`` was trained (it is trained again later); False if it was not."""
        for s, ids in list(self.log.items()):
            if pid in ids:
                ids.remove(pid)
                if not ids:
                    del self.log[s]
                break
        else:
            return False
        self.trained_at[s] -= 1
        self._undo_done(pid)
        return True

    def _undo_done(self, pid: int) -> None:
        serial = self.serial(pid)
        if serial >= self.watermark:
            self.done.discard(pid)
            return
        self.done.update(self.prompt_id(s) for s in range(serial + 1, self.watermark))
        self.watermark = serial

    def _prune_log(self) -> None:
        oldest = (self.watermark // self.num_prompts - (LOG_EPOCHS - 1)) * self.num_prompts
        for s in [s for s, ids in self.log.items() if max(ids) < oldest]:
            del self.log[s]

    # -- checkpoint state ------------------------------------------------------------------------
    def state(self, step: int | None = None) -> dict:
        """What a run resumed from the checkpoint of ``step`` needs: prompts trained after
        ``step`` count as not done, and the run's counts go on from ``counts``."""
        if self.num_prompts is None:  # no prompt taken yet
            return self.start or {"num_prompts": None, "watermark": 0, "next": 0, "done": [], "trained": []}
        later = {pid for s, ids in self.log.items() if step is not None and s > step for pid in ids}
        not_done = [s for s in range(self.watermark, self.next_serial)
                    if (pid := self.prompt_id(s)) not in self.done or pid in later]
        not_done += [self.serial(pid) for pid in later if self.serial(pid) < self.watermark]
        watermark = min(not_done, default=self.next_serial)
        skip = set(not_done)
        done = sorted(self.prompt_id(s) for s in range(watermark, self.next_serial) if s not in skip)
        trained = [[s, list(ids)] for s, ids in sorted(self.log.items()) if step is None or s <= step]
        return {"num_prompts": self.num_prompts, "shuffle": self.shuffle, "seed": self.seed,
                "epoch": watermark // self.num_prompts, "watermark": watermark, "next": self.next_serial,
                "done": done, "trained": trained, "counts": {**self.counts, "trained": self.trained_by(step)}}

    def summary(self) -> dict:
        """Where the stream stands, cheaply (no per-prompt lists): for status and metrics."""
        return {"epoch": self.epoch, "watermark": self.watermark, "next": self.next_serial,
                "retry": len(self.retry), "buffered_prompts": len(self.buffered),
                "at_makers": sum(map(len, self.at_maker.values()))}

    def _restore(self, start: dict) -> None:
        if "position" in start and "watermark" not in start:  # format of checkpoints before prompt ids
            start = {"num_prompts": self.num_prompts, "watermark": start["epoch"] * self.num_prompts + start["position"],
                     "next": start["epoch"] * self.num_prompts + start["position"], "done": [], "trained": []}
        if start.get("num_prompts") not in (None, self.num_prompts):
            raise LedgerError(f"the checkpoint's prompt stream has {start['num_prompts']} prompts, the prompt data "
                              f"now has {self.num_prompts}: resume with the same data.path (prompt identities "
                              f"are rows of it)")
        if start.get("num_prompts") is None:
            return
        self.watermark, self.next_serial = start["watermark"], start["next"]
        done = set(start["done"])
        self.retry.extend(pid for s in range(self.watermark, self.next_serial) if (pid := self.prompt_id(s)) not in done)
        self.done = done
        self.log = {int(s): list(ids) for s, ids in start.get("trained", [])}

"""The coordinator's prompt stream: the prompt dataset's prompts served to makers in the
ledger's order (``ray_ppo.coordinator.ledger``), epoch after epoch."""

from __future__ import annotations

import functools
from typing import Any, Callable

from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.data import Prompt, read_texts
from ray_ppo.wire.messages import PromptBatch


class PromptFeed:
    """Serves the prompt dataset's prompts in the ledger's order (``ray_ppo.coordinator.ledger``), epoch after epoch.

    The prompts are read once, in file order (Ray Data keeps the order only when asked:
    ``execution_options.preserve_order``), and kept by the coordinator: a prompt id names a row,
    so the same row must come back at the same index on every read, also after a resume.
    ``read`` blocks: the coordinator runs it in a worker thread and hands the prompts to ``load``.
    """

    def __init__(self, read: Callable[[], list[Prompt | None]], ledger: PromptLedger):
        self.read, self.ledger = read, ledger
        self.prompts: list[Prompt | None] | None = None
        self.first_prompt: Prompt | None = None  # the first prompt this feed served (where a resume restarted)
        self.served = 0  # prompts handed out
        self.epochs = 0  # full passes over the dataset started

    @classmethod
    def of_dataset(cls, dataset: Any, ledger: PromptLedger, column: str = "prompt") -> PromptFeed:
        """A feed over the prompts in ``column`` of a Ray Dataset."""
        return cls(functools.partial(read_texts, dataset, column), ledger)

    @property
    def loaded(self) -> bool:
        return self.prompts is not None

    def load(self, prompts: list[Prompt | None]) -> None:
        self.prompts = prompts
        self.ledger.configure(len(prompts))

    def next(self, maker_id: int, n: int) -> PromptBatch:
        """The next ``n`` prompts for ``maker_id`` (requeued ones first; the stream wraps into the
        next epoch, so always ``n``)."""
        ids = self.ledger.take(n, maker_id)
        prompts = [self.prompts[self.ledger.row(pid)] for pid in ids]
        if self.first_prompt is None:
            self.first_prompt = prompts[0]
        self.served += len(prompts)
        self.epochs = self.ledger.epoch + 1
        return PromptBatch(prompts, ids)

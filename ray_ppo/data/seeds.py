"""Every random stream of a run, derived from its one ``seed``; no Ray, no torch.

  - ``rank_seed``: a trainer rank's minibatch shuffling (``PPOLearner``'s generator); the
    synchronous loop is rank 0;
  - ``maker_seed``: a maker's sampling (torch's and its vLLM engine's), apart from every rank's
    and every other maker's;
  - ``prompt_order``: the order an epoch serves the prompts in. The coordinator's prompt ledger
    (``ray_ppo.coordinator.ledger``) and the synchronous loop (``ray_ppo.local``) both serve it, so
    a run of either with the same ``seed``, prompts and ``data.shuffle`` sees the prompts in the
    same order. A checkpoint counts the prompt stream's position in it (``PromptLedger.state``):
    another order would make a resumed run serve other prompts.

Each process also seeds torch with ``seed`` itself, so that every trainer rank and the
synchronous loop build the same initial weights.
"""

from __future__ import annotations

import numpy as np

MAKER_SEED_STRIDE = 1000
"""Distance between two makers' seeds, and between the ranks' seeds and maker 0's: ranks use
``seed`` to ``seed + num_workers - 1``."""


def rank_seed(seed: int, rank: int) -> int:
    """The seed of trainer rank ``rank``'s learner."""
    return seed + rank


def maker_seed(seed: int, maker_id: int) -> int:
    """The seed of maker ``maker_id``'s sampling."""
    return seed + MAKER_SEED_STRIDE * (maker_id + 1)


def prompt_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The rows of ``n`` prompts in the order epoch ``epoch`` serves them: a permutation seeded by
    ``seed + epoch`` (a new one each epoch) with ``shuffle``, else file order."""
    return np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)

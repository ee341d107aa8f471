"""Continuous batching for an HF causal LM: up to ``max_running`` sequences decode together, a
sequence that ends frees its slot at once, and a waiting prompt is admitted into it at the next
step, so no slot waits for the longest answer of a batch. Weights may change between two decode
steps (``swap``): every sampled token records the policy version that sampled it.

    batcher = ContinuousBatcher(model, params, pad_token_id, stop_ids, max_running=32)
    batcher.submit([Request(key=i, prompt=ids) for i, ids in enumerate(prompts)])
    while batcher.busy:
        for done in batcher.step():          # the sequences that ended at this step
            print(done.key, done.tokens, done.log_probs, done.versions)
        batcher.swap(load_new_weights, version=7)   # between steps, when a push is staged

The running sequences share one key/value cache, left-aligned as HF ``generate`` aligns a
batch: every row ends at the cache's last column, and a row's earlier columns past its own
tokens are masked padding. A prompt admitted into a running batch is prefilled on its own (a
batch of the prompts admitted together) and its cache joins the batch, padded on the left to the
batch's length (or the batch padded to its length). A row's padding is at most the age of the
oldest running row, so the waste is bounded by ``max_prompt + max_new_tokens`` columns, and the
columns no running row uses any more are dropped as rows leave.

At a swap, the cache the running sequences built under the old weights is kept
(``kv_at_swap="keep"``: their next tokens are sampled by the new weights over a context the old
ones encoded) or recomputed with the new weights (``"recompute"``: exact, one prefill of every
running context). Either way the tokens sampled before the swap keep the old version and their
log-probs under the old weights (the behaviour policy of each token).

Waiting requests are admitted in order (``schedule="fifo"``), or those expected to answer longest
first (``"longest_first"``, by ``Request.expected_len``), so that the tail of a stream is not one
long answer running alone in an otherwise empty batch.

Sampling is ``ray_ppo.models.generation.generate``'s: softmax(logits / temperature), cut by top-k and
top-p; each token's log-prob is log_softmax(logits / temperature) of the uncut logits, as
``SampledLogProbs`` records it. Dimensions: S = running sequences, L = cache length, V = vocabulary.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch import nn

from ray_ppo.algo import log_probs_from_logits
from ray_ppo.config import SamplingParams
from ray_ppo.models.generation import Rollout, left_pad, model_device, rollout_of_responses

KvAtSwap = Literal["keep", "recompute"]
Schedule = Literal["fifo", "longest_first"]


@dataclass
class Request:
    """One sequence to generate: ``prompt`` token ids; ``key`` is the caller's, handed back with
    the result; ``max_new_tokens`` caps this sequence (None: the sampling settings' cap);
    ``expected_len``: how long its answer is expected to be, for ``schedule="longest_first"``
    (None: unknown, ranked as the mean of the known ones)."""

    key: Any
    prompt: Sequence[int]
    max_new_tokens: int | None = None
    expected_len: float | None = None


@dataclass
class Finished:
    """A generated sequence: its response ``tokens`` (ending on a stop id when ``stopped``, else cut
    at its cap), each token's sampler log-prob and the policy version that sampled it."""

    key: Any
    prompt: list[int]
    tokens: list[int]
    log_probs: list[float]
    versions: list[int]
    stopped: bool
    swaps: int
    """Weight swaps while this sequence was running (its tokens span ``swaps + 1`` versions at most)."""

    @property
    def version_runs(self) -> list[tuple[int, int]]:
        """The versions as runs: ``[(version, count), ...]`` in token order."""
        return version_runs(self.versions)


def version_runs(versions: Iterable[int]) -> list[tuple[int, int]]:
    """Per-token versions as runs: ``[(version, count), ...]`` in token order."""
    runs: list[tuple[int, int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


@dataclass
class RunningSequence:
    """A running sequence: its request, what it generated, and the token sampled but not yet fed."""

    request: Request
    cap: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    swaps: int = 0

    def context(self) -> list[int]:
        """The tokens in the cache: the prompt and every generated token but the last (still to be fed)."""
        return [*self.request.prompt, *self.tokens[:-1]]


class Slots:
    """What every batcher of ``ContinuousBatcher``'s interface keeps alike (``VllmBatcher`` and the
    simulated device's too): its settings, checked; the waiting queue; the slot and cache counts;
    and what a weight swap does to the running sequences' records. A subclass keeps its running
    sequences as ``rows``."""

    def __init__(self, max_running: int, kv_at_swap: KvAtSwap, schedule: Schedule, version: int):
        if max_running < 1:
            raise ValueError(f"max_running={max_running}: at least one sequence must be able to run")
        if kv_at_swap not in ("keep", "recompute"):
            raise ValueError(f"kv_at_swap={kv_at_swap!r}: use 'keep' or 'recompute'")
        if schedule not in ("fifo", "longest_first"):
            raise ValueError(f"schedule={schedule!r}: use 'fifo' or 'longest_first'")
        self.max_running, self.kv_at_swap, self.schedule, self.version = max_running, kv_at_swap, schedule, version
        self.waiting: deque[Request] = deque()
        self.steps = 0
        self.slot_steps = 0  # sum over decode steps of the rows running: max_running * steps when always full
        self.kv_kept = self.kv_recomputed = 0  # running sequences whose cache a swap kept / recomputed

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests``; they are admitted in order as slots free."""
        for request in requests:
            if len(request.prompt) == 0:
                raise ValueError(f"request {request.key!r} has an empty prompt: every prompt needs at least one token")
            self.waiting.append(request)

    @property
    def busy(self) -> bool:
        """Whether any sequence is running or waiting."""
        return bool(self.rows or self.waiting)

    @property
    def utilisation(self) -> float:
        """Of the decode steps' slots, the share that held a running sequence (1.0 when always full)."""
        return self.slot_steps / (self.steps * self.max_running) if self.steps else 0.0

    def _swapped(self, version: int) -> list:
        """After the weights changed to ``version``: the next tokens record it, each running sequence
        counts the swap, and its cache counts as kept or recomputed (``kv_at_swap``); the running
        sequences."""
        self.version = version
        rows = self.rows
        for row in rows:
            row.swaps += 1
        if self.kv_at_swap == "keep":
            self.kv_kept += len(rows)
        else:
            self.kv_recomputed += len(rows)
        return rows


class ContinuousBatcher(Slots):
    """Generates ``Request``s with up to ``max_running`` in flight (see the module docstring).

    Args:
        model: a ``transformers`` causal LM (or a peft model over one) that takes ``past_key_values``
            and ``position_ids``.
        params: the sampling settings (temperature, top_k, top_p, max_new_tokens).
        pad_token_id: the id fed at padded positions (masked out).
        stop_ids: the ids that end a response (``stop_token_ids``); the stop token is kept.
        max_running: how many sequences decode together at most.
        kv_at_swap: ``"keep"`` or ``"recompute"`` the running sequences' cache at a weight swap.
        greedy: the most likely token at each step instead of a sample.
        version: the policy version of the weights the model holds now.
        generator: the random generator sampling draws from (None: torch's global one).
    """

    def __init__(self, model: nn.Module, params: SamplingParams, pad_token_id: int, stop_ids: Iterable[int],
                 max_running: int, kv_at_swap: KvAtSwap = "keep", greedy: bool = False, version: int = 0,
                 generator: torch.Generator | None = None, schedule: Schedule = "fifo"):
        super().__init__(max_running, kv_at_swap, schedule, version)
        self.model, self.params, self.pad_token_id = model, params, pad_token_id
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.greedy, self.generator = greedy, generator
        self.rows: list[RunningSequence] = []
        self.cache = None  # the running rows' key/value cache, (S, heads, L, head_dim) per layer
        self.mask: torch.Tensor | None = None  # (S, L) 1 on each row's real tokens in the cache
        self._cache_arg = _cache_argument(model)

    # -- the caller's side ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, admit: bool = True) -> list[Finished]:
        """Admit waiting requests into free slots (prefilling them), then one decode step of every
        running sequence; returns the sequences that ended (a stop id, or their cap), in any order.

        Args:
            admit: False admits nothing (the running sequences drain, e.g. before a weight swap).

        Returns:
            The ``Finished`` sequences of this step (possibly none).
        """
        finished = self._admit() if admit else []
        if self.rows:
            self._decode()
            finished += self._retire()
        return finished

    def run(self, requests: Iterable[Request]) -> list[Finished]:
        """Generate ``requests`` to the end on an idle batcher; their results in order.

        Args:
            requests: the sequences to generate.

        Returns:
            One ``Finished`` per request, in the requests' order, each with its request's key.
        """
        if self.busy:
            raise RuntimeError("run() needs an idle batcher; drive a shared one with submit() and step()")
        requests = list(requests)
        tag = object()  # marks this call's requests among any others queued
        self.submit(Request((tag, i), r.prompt, r.max_new_tokens, r.expected_len) for i, r in enumerate(requests))
        done: dict[int, Finished] = {}
        while len(done) < len(requests):
            for f in self.step():
                if isinstance(f.key, tuple) and len(f.key) == 2 and f.key[0] is tag:
                    index = f.key[1]
                    f.key = requests[index].key
                    done[index] = f
        return [done[i] for i in range(len(requests))]

    @torch.no_grad()
    def swap(self, apply: Callable[[], None], version: int) -> None:
        """Between two steps: ``apply()`` changes the model's weights to those of ``version``; the
        running sequences go on from where they are, their cache kept or recomputed
        (``kv_at_swap``).

        Args:
            apply: changes the weights (the maker's staged push swapped in).
            version: the policy version of the new weights.
        """
        apply()
        if self._swapped(version) and self.kv_at_swap == "recompute":
            self.cache, self.mask = self._prefill([row.context() for row in self.rows])[1:]

    # -- inside ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def _admit(self) -> list[Finished]:
        """Prefill the waiting requests that fit into the free slots; join their cache to the batch."""
        free = self.max_running - len(self.rows)
        if self.schedule == "longest_first" and free > 0 and self.waiting:
            self.waiting = longest_first(self.waiting)
        admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if not admitted:
            return []
        logits, cache, mask = self._prefill([list(r.prompt) for r in admitted])
        rows = [RunningSequence(r, r.max_new_tokens or self.params.max_new_tokens) for r in admitted]
        self._join(cache, mask)
        self.rows += rows
        self._sample(rows, logits)
        return self._retire()  # a sequence may end on its first token


    def _prefill(self, contexts: list[list[int]]):
        """One forward pass over left-padded ``contexts``: (last logits (n, V), cache, mask (n, L))."""
        from transformers import DynamicCache

        input_ids, mask = left_pad(contexts, self.pad_token_id)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        cache = DynamicCache()
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=_positions(mask),
                         use_cache=True, **{self._cache_arg: cache})
        return out.logits[:, -1, :], cache, mask

    def _join(self, cache, mask: torch.Tensor) -> None:
        """Append the rows of ``cache`` / ``mask`` to the running batch, left-padding the shorter."""
        if self.cache is None or not self.rows:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])

    def _decode(self) -> None:
        """Feed every running row its last token; sample the next."""
        last = torch.tensor([[row.tokens[-1]] for row in self.rows], dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        out = self.model(input_ids=last, attention_mask=self.mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: self.cache})  # grows the cache in place
        self.steps += 1
        self.slot_steps += len(self.rows)
        self._sample(self.rows, out.logits[:, -1, :])

    def _sample(self, rows: list[RunningSequence], logits: torch.Tensor) -> None:
        """Sample one token for each of ``rows`` (the last len(rows) rows of the batch) from ``logits`` (n, V)."""
        scaled = logits.float() / self.params.temperature
        if self.greedy:
            tokens = scaled.argmax(dim=-1)
        else:
            probs = torch.softmax(_top_k_top_p(scaled, self.params.top_k, self.params.top_p), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        chosen = log_probs_from_logits(scaled, tokens)
        for row, token, log_prob in zip(rows, tokens.tolist(), chosen.tolist(), strict=True):
            row.tokens.append(token)
            row.log_probs.append(log_prob)
            row.versions.append(self.version)

    def _retire(self) -> list[Finished]:
        """Remove the rows that ended from the batch; drop the cache columns no row uses any more."""
        stop = set(self.stop_ids.tolist())
        ended = [i for i, row in enumerate(self.rows) if row.tokens[-1] in stop or len(row.tokens) >= row.cap]
        if not ended:
            return []
        finished = []
        for i in ended:
            row = self.rows[i]
            finished.append(Finished(row.request.key, list(row.request.prompt), row.tokens, row.log_probs,
                                     row.versions, stopped=row.tokens[-1] in stop, swaps=row.swaps))
        keep = [i for i in range(len(self.rows)) if i not in set(ended)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return finished
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, index)
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        return finished



def _cache_argument(model: nn.Module) -> str:
    """The name ``model``'s forward takes its key/value cache by: ``cache`` (transformers >= 5.20),
    else ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it on
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (0 at each row's first real token)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def longest_first(waiting: Iterable[Request]) -> deque[Request]:
    """The waiting requests ordered by expected answer length, longest first (a stable sort: equal
    ones keep their order); an unknown length ranks as the mean of the known ones (all unknown:
    the order as given)."""
    waiting = deque(waiting)
    known = [r.expected_len for r in waiting if r.expected_len is not None]
    if not known:
        return waiting
    mean = sum(known) / len(known)
    return deque(sorted(waiting, key=lambda r: -(mean if r.expected_len is None else r.expected_len)))


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` padded with zeros on the left of its sequence dimension (-1 for a mask, -2 for keys) to ``width``."""
    dim = -1 if t.dim() == 2 else -2
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _layers(cache) -> list:
    """The per-layer key/value holders of a ``transformers`` ``DynamicCache`` (``.keys``, ``.values``)."""
    return cache.layers


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (n, V) with the tokens outside the top-k and the top-p nucleus set to -inf, as
    transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` cut them (k = 0 and p = 1: no cut)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def rollout_of(finished: Sequence[Finished], pad_token_id: int) -> tuple[Rollout, torch.Tensor]:
    """Finished sequences as one padded ``Rollout`` (prompts left-padded, responses right-padded,
    the sampler's log-probs as ``log_probs``) and each sequence's oldest token version.

    Args:
        finished: the sequences, in the order the rollout's rows take.
        pad_token_id: the id written at padded positions.

    Returns:
        The rollout (B = len(finished), on the CPU) and a (B,) int64 tensor of each row's oldest
        token version (the policy version a staleness bound counts it at).
    """
    rollout = rollout_of_responses([f.prompt for f in finished], [f.tokens for f in finished],
                                   [f.log_probs for f in finished], pad_token_id)
    return rollout, torch.tensor([min(f.versions) for f in finished], dtype=torch.long)

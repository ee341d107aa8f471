"""Padding-free forward passes: a padded batch's real tokens laid end to end in one row, each
prompt computed once for all the responses that share it.

A padded batch (prompts left-padded to P, responses right-padded to R) computes B x (P + R)
positions. A GRPO step of 4 answers per prompt repeats each prompt 4 times; on SmolLM2's
arithmetic the prompt is 43 tokens and an answer about 15, so two thirds of what a padded pass
computes is a prompt again. ``Layout`` keeps each row's attended tokens only (so no padding) and
lays them out as segments of one row:

- a prompt answered once: one segment, prompt then response, causal attention within it;
- a prompt answered n > 1 times (rows whose attended prompt tokens are equal): the prompt once,
  then each response as its own segment, which attends to the prompt and causally to itself.

Positions restart at each segment (a response continues its prompt's), so every token sees
exactly the keys and positions it sees in the padded batch: the log-probs, values and gradients
are the padded pass's up to float rounding (tests/unit/test_packing.py checks them at 1e-5).
The vocabulary-wide logits are computed only at the positions that predict a response token
(``logits_to_keep`` given as indices), not at every padded response column.

Attention runs through ``torch.nn.functional.scaled_dot_product_attention``, which is what CPUs
have: one call per layer over every segment of the row, each padded to the longest, under a
mask built once per pass (``Gather``). On a GPU, in float16 or bfloat16, it runs through
PyTorch's FlashAttention variable-length kernel instead (``torch.nn.attention.varlen``, where
the installed torch has it): the queries are the packed row as it is, each segment's keys its
prompt's and its own, with causal attention aligned at the bottom right, so nothing is padded.
``enable_packing`` registers the function with
transformers' ``AttentionInterface`` under ``ATTENTION``. Outside a packed pass
(``Layout.active``) that function is transformers' own SDPA, so generation and padded passes of
the same model are unchanged.

Shapes: B = rows, T = P + R columns of the padded batch, N = tokens of the packed row, K =
response tokens (the positions whose logits are computed), H = heads, D = head size.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

ATTENTION = "ray_ppo_packed"
"""The name of the packed-aware attention in transformers' ``AttentionInterface``."""

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("ray_ppo_packed_layout", default=None)


@dataclass(frozen=True)
class Segment:
    """Positions ``start:stop`` of the packed row, which attend causally among themselves, after
    the shared prompt at positions ``prefix`` (start, stop) when it is not None."""

    start: int
    stop: int
    prefix: tuple[int, int] | None = None

    def keys(self) -> torch.Tensor:
        """The packed positions this segment's queries attend to: its prompt's, then its own."""
        own = torch.arange(self.start, self.stop)
        return own if self.prefix is None else torch.cat([torch.arange(*self.prefix), own])


@dataclass(frozen=True)
class Gather:
    """The segments of a packed row as one padded batch of attention problems, so a layer makes a
    single SDPA call: S segments, queries padded to Lq, keys to Lk."""

    queries: torch.Tensor
    """(S, Lq) int64 packed positions of each segment's queries (padding: position 0)."""
    keys: torch.Tensor
    """(S, Lk) int64 packed positions of each segment's keys (padding: position 0)."""
    visible: torch.Tensor
    """(S, 1, Lq, Lk) bool, True where a query sees a key: its prompt, itself and its segment's
    earlier tokens; a padding query sees key 0 only, so no row is all False (no NaN)."""
    back: torch.Tensor
    """(N,) int64, where each packed position's output lies in the (S * Lq) flattened queries."""
    flat_keys: torch.Tensor
    """(Nk,) int64, the packed positions of every segment's keys, segment after segment (varlen)."""
    cu_queries: torch.Tensor
    """(S + 1,) int32, where each segment's queries start in the packed row (varlen)."""
    cu_keys: torch.Tensor
    """(S + 1,) int32, where each segment's keys start in ``flat_keys`` (varlen)."""

    @classmethod
    def of(cls, segments: tuple[Segment, ...], size: int) -> Gather:
        if [s.start for s in segments] != [0, *(s.stop for s in segments[:-1])] or segments[-1].stop != size:
            raise ValueError("the segments must cover the packed row in order")  # what varlen's queries assume
        keys = [s.keys() for s in segments]
        lq, lk = max(s.stop - s.start for s in segments), max(k.numel() for k in keys)
        queries = torch.zeros(len(segments), lq, dtype=torch.long)
        key_index = torch.zeros(len(segments), lk, dtype=torch.long)
        visible = torch.zeros(len(segments), 1, lq, lk, dtype=torch.bool)
        visible[:, 0, :, 0] = True
        back = torch.empty(size, dtype=torch.long)
        for i, (s, k) in enumerate(zip(segments, keys)):
            n, before = s.stop - s.start, k.numel() - (s.stop - s.start)
            queries[i, :n] = torch.arange(s.start, s.stop)
            key_index[i, :k.numel()] = k
            visible[i, 0, :n, :k.numel()] = torch.ones(n, k.numel(), dtype=torch.bool).tril(before)
            back[s.start:s.stop] = torch.arange(i * lq, i * lq + n)
        cumulative = lambda lengths: torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        return cls(queries, key_index, visible, back, torch.cat(keys),
                   cumulative([s.stop - s.start for s in segments]), cumulative([k.numel() for k in keys]))

    @property
    def longest(self) -> tuple[int, int]:
        """(Lq, Lk): the most queries and keys of one segment."""
        return self.queries.shape[1], self.keys.shape[1]

    def to(self, device: torch.device) -> Gather:
        return Gather(*(t.to(device) for t in (self.queries, self.keys, self.visible, self.back, self.flat_keys,
                                               self.cu_queries, self.cu_keys)))


@dataclass(frozen=True)
class Layout:
    """Where a padded batch's tokens go in the packed row, and where its results go back.

    Build it with ``Layout.of``; run a model inside ``with layout.active():``.
    """

    input_ids: torch.Tensor
    """(1, N) int64, the packed row."""
    position_ids: torch.Tensor
    """(1, N) int64, each token's position within its sequence (prompt then response)."""
    segments: tuple[Segment, ...]
    """The packed row's attention segments, in row order."""
    gather: Gather
    """The segments as one batch of attention problems."""
    keep: torch.Tensor
    """(K,) int64, the packed positions whose outputs predict (logits) or value (critic) a response token."""
    targets: torch.Tensor
    """(K,) int64, the response token each kept position predicts."""
    rows: torch.Tensor
    """(K,) int64, the padded row of each response token."""
    cols: torch.Tensor
    """(K,) int64, its response column (0 .. R-1)."""
    shape: tuple[int, int]
    """(B, R), the padded per-token shape the results go back to."""

    @classmethod
    def of(cls, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
           share_prompts: bool = True) -> Layout:
        """The layout of a padded batch.

        Args:
            sequences: (B, T) int64 token ids, left-padded prompts then right-padded responses.
            attention_mask: (B, T) 0/1 tensor, 1 on real tokens.
            num_actions: R, the response columns at the end of each row.
            share_prompts: compute a prompt once for all the rows that share it (else once per row).

        Returns:
            The layout, its tensors on ``sequences``' device.

        Raises:
            ValueError: if a row has no attended prompt token (its first response token has no predictor).
        """
        B, T = sequences.shape
        P = T - num_actions
        tokens, mask = sequences.cpu(), attention_mask.cpu().bool()
        build = _Builder(tokens, mask, P)
        for rows in prompt_groups(sequences, attention_mask, num_actions) if share_prompts else [[i] for i in range(B)]:
            build.group(rows)
        device = sequences.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(input_ids=torch.cat(build.ids).to(device).unsqueeze(0),
                   position_ids=torch.cat(build.positions).to(device).unsqueeze(0), segments=tuple(build.segments),
                   gather=Gather.of(tuple(build.segments), build.size).to(device),
                   keep=torch.cat(build.keep).to(device), targets=torch.cat(build.targets).to(device),
                   rows=as_tensor(build.rows), cols=torch.cat(build.cols).to(device), shape=(B, num_actions))

    @property
    def num_tokens(self) -> int:
        """N, the tokens a packed pass computes."""
        return self.input_ids.shape[1]

    @contextlib.contextmanager
    def active(self):
        """The context in which the packed-aware attention reads this layout."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(K,) per-response-token values -> (B, R), 0 at the padded columns.

        Args:
            values: (K,) float tensor, in ``keep`` order.

        Returns:
            (B, R) tensor of ``values``' dtype (differentiable).
        """
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


class _Builder:
    """Accumulates a layout's pieces group by group (``Layout.of``)."""

    def __init__(self, tokens: torch.Tensor, mask: torch.Tensor, prompt_width: int):
        self.tokens, self.mask, self.P = tokens, mask, prompt_width
        self.ids, self.positions, self.keep, self.targets, self.cols = [], [], [], [], []
        self.rows: list[int] = []
        self.segments: list[Segment] = []
        self.size = 0

    def _append(self, ids: torch.Tensor, first_position: int) -> int:
        start = self.size
        self.ids.append(ids)
        self.positions.append(torch.arange(first_position, first_position + ids.numel()))
        self.size += ids.numel()
        return start

    def group(self, rows: list[int]) -> None:
        """Lay out the rows that share one prompt: one segment for a lone row, else the prompt and a segment per row."""
        P = self.P
        prompt = self.tokens[rows[0], :P][self.mask[rows[0], :P]]
        p = prompt.numel()
        if p == 0:
            raise ValueError(f"row {rows[0]} has no attended prompt token, so nothing predicts its first response "
                             f"token; every row needs a prompt of at least one token")
        prompt_start = self._append(prompt, 0)
        shared = len(rows) > 1
        if shared:
            self.segments.append(Segment(prompt_start, self.size))
        for row in rows:
            cols = self.mask[row, P:].nonzero().flatten()
            response = self.tokens[row, P:][cols]
            start = self._append(response, p)
            r = response.numel()
            # the token at response index j is predicted at the position before it: the prompt's last token for j = 0
            predictors = torch.cat([torch.tensor([prompt_start + p - 1]), torch.arange(start, start + r - 1)])
            self.keep.append(predictors[:r])
            self.targets.append(response)
            self.cols.append(cols)
            self.rows.extend([row] * r)
            if shared:
                self.segments.append(Segment(start, self.size, (prompt_start, prompt_start + p)))
            else:
                self.segments.append(Segment(prompt_start, self.size))


def prompt_groups(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> list[list[int]]:
    """The rows of a padded batch grouped by their attended prompt tokens, in order of first row.

    Args:
        sequences: (B, T) int64 token ids, left-padded prompts then right-padded responses.
        attention_mask: (B, T) 0/1 tensor, 1 on real tokens.
        num_actions: R, the response columns at the end of each row.

    Returns:
        Lists of row indices; rows of one list have equal prompts.
    """
    P = sequences.shape[1] - num_actions
    tokens, mask = sequences[:, :P].cpu(), attention_mask[:, :P].cpu().bool()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(tokens.shape[0]):
        groups.setdefault(tuple(tokens[row][mask[row]].tolist()), []).append(row)
    return list(groups.values())


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: (1, H, N, D) query, (1, Hkv, N, D) key and value
    -> ((1, N, H, D) output, None). Segment by segment inside ``Layout.active``; elsewhere SDPA's."""
    layout = _ACTIVE.get()
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    g = layout.gather
    if _uses_varlen(query, dropout if module.training else 0.0):
        k, v = (t[0][:, g.flat_keys].transpose(0, 1) for t in (key, value))  # (Nk, Hkv, D)
        out = _varlen_attn(query[0].transpose(0, 1), k, v, g.cu_queries, g.cu_keys, *g.longest, scale=scaling,
                           window_size=(-1, 0), enable_gqa=k.shape[1] != query.shape[1])  # (N, H, D)
        return out.unsqueeze(0), None
    q = query[0][:, g.queries].transpose(0, 1)  # (S, H, Lq, D)
    k, v = (t[0][:, g.keys].transpose(0, 1) for t in (key, value))  # (S, Hkv, Lk, D)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: SDPA's enable_gqa is torch>=2.5 only
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=g.visible,
                                                           dropout_p=dropout if module.training else 0.0, scale=scaling)
    out = out.transpose(0, 1).flatten(1, 2)[:, g.back]  # (H, N, D)
    return out.transpose(0, 1).unsqueeze(0), None  # (1, N, H, D)


try:  # PyTorch's FlashAttention variable-length kernel (CUDA only); absent from older torch
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:
    _varlen_attn = None


def _uses_varlen(query: torch.Tensor, dropout: float) -> bool:
    """Whether a packed pass's attention runs through ``_varlen_attn``: a CUDA query in float16 or
    bfloat16 (FlashAttention's dtypes), a torch that has the kernel, and no attention dropout
    (which the kernel does not take)."""
    return (_varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and dropout == 0.0)


def _mask(*args, **kwargs):
    """No mask inside a packed pass (the segments are the mask); SDPA's elsewhere."""
    if _ACTIVE.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def pretrained_of(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model``: through peft's base model, the ``.module`` of DDP
    and ColossalAI wrappers and a ``Critic``'s backbone.

    Args:
        model: the model, possibly wrapped.

    Returns:
        The innermost module found.
    """
    inner = model
    while True:
        if hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), nn.Module):
            inner = inner.module
        elif isinstance(getattr(inner, "backbone", None), nn.Module):
            inner = inner.backbone
        else:
            return inner


def keeps_logits(model: nn.Module) -> bool:
    """Whether ``model`` computes logits for its last positions only when told ``logits_to_keep``
    (transformers' causal LMs since 4.50), looking through peft's base model and the ``.module``
    of DDP and ColossalAI wrappers, which pass the keyword on.

    Args:
        model: the model, possibly wrapped.

    Returns:
        Whether its forward takes ``logits_to_keep``.
    """
    return _forward_takes(type(pretrained_of(model)), "logits_to_keep")


@functools.cache
def _forward_takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters


def enable_packing(model: nn.Module) -> str | None:
    """Switch ``model``'s attention to the packed-aware one, so ``packs(model)`` holds.

    Args:
        model: a transformers model, possibly wrapped (``pretrained_of``), before training wraps it.

    Returns:
        None, or why it cannot pack (its passes then stay padded).
    """
    inner = pretrained_of(model)
    config = getattr(inner, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == ATTENTION:
        return None
    if implementation != "sdpa":
        return f"its attention is {implementation!r}; packing replaces 'sdpa' only"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "its config sets sliding_window, which packed attention does not implement"
    if getattr(config, "attn_logit_softcapping", None):
        return "its config sets attn_logit_softcapping, which packed attention does not implement"
    if not hasattr(inner, "set_attn_implementation"):
        return "its transformers version has no set_attn_implementation"
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        return f"its transformers version has no attention or mask interface to register with ({e})"
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    inner.set_attn_implementation(ATTENTION)
    return None


def packs(model: nn.Module) -> bool:
    """Whether ``model`` runs its passes packed (``enable_packing`` switched it)."""
    return getattr(getattr(pretrained_of(model), "config", None), "_attn_implementation", None) == ATTENTION


def packed_log_probs(model: nn.Module, layout: Layout, temperature: float = 1.0,
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of a batch's response tokens from one packed pass of a causal LM.

    Args:
        model: a causal LM that ``packs``.
        layout: the batch's ``Layout``.
        temperature: the sampling temperature the logits are divided by.
        entropy: also return each position's entropy.

    Returns:
        ((B, R) float32 log-probs, (B, R) float32 entropies or None), 0 at the padded columns.
    """
    from ray_ppo.algo import entropy_from_logits, log_probs_from_logits
    keep = {"logits_to_keep": layout.keep} if keeps_logits(model) else {}
    with layout.active():
        out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False, **keep)
    logits = (out.logits[0] if keep else out.logits[0, layout.keep]).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = layout.unpack(log_probs_from_logits(logits, layout.targets))
    return log_probs, layout.unpack(entropy_from_logits(logits)) if entropy else None


def packed_values(critic: nn.Module, layout: Layout) -> torch.Tensor:
    """Values (B, R), in float32, of the states in which each response token was chosen, from one packed pass.

    Args:
        critic: a value model whose ``forward(input_ids, position_ids=...)`` gives per-token values (``Critic``).
        layout: the batch's ``Layout``.

    Returns:
        (B, R) float32 tensor, 0 at the padded columns.
    """
    with layout.active():
        values = critic(layout.input_ids, position_ids=layout.position_ids)
    return layout.unpack(values[0, layout.keep].float())


def pass_tokens(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, rows: list[int],
                packed: bool) -> int:
    """The tokens a pass over ``rows`` of a padded batch computes.

    Args:
        sequences: (B, T) int64 token ids, left-padded prompts then right-padded responses.
        attention_mask: (B, T) 0/1 tensor, 1 on real tokens.
        num_actions: R, the response columns at the end of each row.
        rows: the row indices of the pass.
        packed: a packed pass (each shared prompt once, no padding), else a padded one (rows x T).

    Returns:
        The number of token positions.
    """
    if not packed:
        return len(rows) * sequences.shape[1]
    P = sequences.shape[1] - num_actions
    seqs, mask = sequences[rows], attention_mask[rows]
    prompts = sum(int(mask[g[0], :P].sum()) for g in prompt_groups(seqs, mask, num_actions))
    return prompts + int(mask[:, P:].sum())


def micro_batches(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, budget: int,
                  packed: bool, at_least: int = 1) -> list[list[int]]:
    """A padded batch's rows cut into passes of at most ``budget`` tokens (``pass_tokens``), prompt
    groups kept whole where they fit: rows in prompt-group order (packed) or row order (padded), a
    pass closed when the next row would take it over the budget (a row over the budget alone is a
    pass of its own). Then, while there are fewer than ``at_least`` passes, the costliest pass of
    two rows or more is halved: ranks cut into equally many passes, so their collectives pair up.

    Args:
        sequences: (B, T) int64 token ids, left-padded prompts then right-padded responses.
        attention_mask: (B, T) 0/1 tensor, 1 on real tokens.
        num_actions: R, the response columns at the end of each row.
        budget: the most tokens of a pass (``trainer.max_tokens_per_microbatch``); 0 = no limit.
        packed: passes are packed (``pass_tokens``).
        at_least: the fewest passes to return (at most B).

    Returns:
        Lists of row indices, one per pass; together every row once.
    """
    cost = lambda rows: pass_tokens(sequences, attention_mask, num_actions, rows, packed)  # noqa: E731
    groups = prompt_groups(sequences, attention_mask, num_actions) if packed else [[i] for i in range(len(sequences))]
    parts, current = [], []
    for row in (r for g in groups for r in g):
        if current and budget and cost(current + [row]) > budget:
            parts.append(current)
            current = []
        current.append(row)
    parts.append(current)
    while len(parts) < at_least:
        widest = max((p for p in parts if len(p) > 1), key=cost)
        i = parts.index(widest)
        parts[i:i + 1] = [widest[:len(widest) // 2], widest[len(widest) // 2:]]
    return parts

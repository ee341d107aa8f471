"""Sampling responses from a causal LM: left-padded prompts in, a padded rollout out.

Shapes: B = number of prompts, P = prompt width (the longest prompt; the others left-padded),
R = response width (the longest response; the others right-padded), V = vocabulary size.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ray_ppo.algo import log_probs_from_logits
from ray_ppo.config import SamplingParams  # the maker section's sampling settings; cfg.maker is one

logger = logging.getLogger(__name__)

# generation_config.json settings that change the sampling distribution beyond temperature, top-k
# and top-p (each adds a logits processor: transformers' ``GenerationMixin._get_logits_processor``),
# with their neutral values.
_PROCESSOR_SETTINGS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": None,
    "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
    "guidance_scale": None, "renormalize_logits": False, "remove_invalid_values": False, "watermarking_config": None,
}
_told: set[str] = set()  # the checkpoints' settings already named in a warning


@dataclass
class Rollout:
    """Generated sequences. P = prompt width (left-padded), R = response width (right-padded).

    sequences: (B, P+R) int64; attention_mask: (B, P+R); action_mask: (B, R) bool, True on
    response tokens up to and including the first end token (``stop_token_ids``); in a multi-turn
    episode's rollout (``ray_ppo.makers.episodes``) True on the policy's tokens only, while
    attention_mask covers the environment's between them too. All on the device of the model
    that sampled.
    log_probs: (B, R) float32, the sampler's own log-probs of the response tokens (0 past the
    action mask), when asked for (``generate(..., log_probs=True)``) or reported (a vLLM engine).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    log_probs: torch.Tensor | None = None

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def responses(self, stop_ids) -> list[tuple[list[int], bool]]:
        """Each row's response tokens (those of ``action_mask``), and whether they end on one of ``stop_ids``.

        Args:
            stop_ids: the token ids that end a response (``stop_token_ids``).

        Returns:
            B pairs ``(token_ids, stopped)``, in row order.
        """
        rows, mask = self.sequences[:, self.prompt_len:].cpu(), self.action_mask.cpu()
        out = []
        for row, keep in zip(rows, mask, strict=True):
            tokens = row[keep].tolist()
            out.append((tokens, bool(tokens) and tokens[-1] in stop_ids))
        return out


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into (input_ids, attention_mask), each (B, P).

    Args:
        prompts: B lists of token ids, each non-empty.
        pad_token_id: the id written at padded positions.

    Returns:
        Tuple ``(input_ids, attention_mask)``, each a (B, P) int64 CPU tensor; the mask is 1 on real tokens.

    Raises:
        ValueError: if ``prompts`` is empty or a prompt has no token.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def rollout_of_responses(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         log_probs: Sequence[Sequence[float]], pad_token_id: int) -> Rollout:
    """A ``Rollout`` (on the CPU) of responses sampled elsewhere (an engine, a continuous batcher):
    prompts left-padded, responses right-padded, each response's tokens all in the action mask.

    Args:
        prompts: B lists of token ids, each non-empty.
        responses: B lists of sampled token ids, each ending at its end token or its cap.
        log_probs: B lists of the sampler's log-prob of each response token.
        pad_token_id: the id written at padded positions.

    Returns:
        The rollout: (B, P+R) sequences and attention mask, (B, R) action mask and float32 log-probs.
    """
    input_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(len(r) for r in responses)
    tokens = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    sampled = torch.zeros((len(prompts), width), dtype=torch.float32)
    action_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, (ids, lps) in enumerate(zip(responses, log_probs, strict=True)):
        tokens[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        sampled[row, :len(ids)] = torch.as_tensor(list(lps), dtype=torch.float32)
        action_mask[row, :len(ids)] = True
    return Rollout(torch.cat([input_ids, tokens], dim=1), torch.cat([prompt_mask, action_mask.long()], dim=1),
                   action_mask, input_ids.shape[1], log_probs=sampled)


def stop_token_ids(tokenizer, model: nn.Module | None = None) -> tuple[int, ...]:
    """The token ids that end a response: the tokenizer's EOS, every end id of ``model``'s
    generation config (a checkpoint's generation_config.json may list several: Llama-3-Instruct's
    ``<|eot_id|>`` beside ``<|end_of_text|>``), and the pad.

    Plain HF ``generate`` and vLLM stop at the generation config's ids too, so a maker's responses
    end where the checkpoint's would. A pad the policy samples ends its response, as TRL and
    OpenRLHF read one: otherwise the tokens after it would be trained and scored although any
    decoder drops the pad (with ``skip_special_tokens``) and any mask built as ``ids != pad`` hides it.

    Args:
        tokenizer: the policy's tokenizer.
        model: the policy, whose ``generation_config`` may list more end ids; None for none.

    Returns:
        The distinct end ids, in the order above.
    """
    config_ends = end_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    ids = [tokenizer.eos_token_id, *config_ends, tokenizer.pad_token_id]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def end_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    """``eos_token_id`` (one id, several, or None for none) as a list of ids.

    Args:
        eos_token_id: one id, a sequence of ids, or None.

    Returns:
        The ids as a list (empty for None).
    """
    return [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def response_mask(responses: torch.Tensor, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
    """True on tokens up to and including the first end token of each row (B, R); ``eos_token_id``
    is one id or several (any of them ends a response), None for none.

    Args:
        responses: (B, R) int64 tensor of generated token ids.
        eos_token_id: one end id, several, or None.

    Returns:
        (B, R) bool tensor.
    """
    ends = end_ids(eos_token_id)
    if not ends:
        return torch.ones_like(responses, dtype=torch.bool)
    is_end = torch.isin(responses, torch.tensor(ends, device=responses.device)).long()
    ends_before = is_end.cumsum(dim=1) - is_end  # end tokens strictly before t
    return ends_before == 0


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (a quantized model keeps its embeddings as parameters).

    Args:
        model: a model with at least one parameter.

    Returns:
        The device.
    """
    return next(model.parameters()).device


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
             pad_token_id: int, eos_token_id: int | Sequence[int] | None, log_probs: bool = False,
             greedy: bool = False) -> Rollout:
    """Sample one response per prompt with ``model.generate``; the rollout is on ``model``'s device.
    A response ends at its first token in ``eos_token_id`` (one id or several: ``stop_token_ids``
    gives a maker's) or at ``params.max_new_tokens``.

    Only ``params`` shape the sampling distribution: the checkpoint's own generation settings
    (a repetition penalty in its generation_config.json, say) are left out, so the tokens are drawn
    from softmax(logits / temperature) cut by top-k / top-p, the policy whose log-probs PPO uses.
    ``log_probs``: also return log_softmax(logits / temperature) of each sampled token, read from
    generation's own logits (the numbers a forward pass over the sequences gives, up to float
    rounding), so the caller needs no second pass. ``greedy``: the most likely token at each step
    instead (evaluation; ``params`` then give only ``max_new_tokens``).

    Args:
        model: a ``transformers`` causal LM (or a peft model over one).
        prompts: B lists of token ids, each non-empty.
        params: the sampling settings (temperature, top_k, top_p, max_new_tokens).
        pad_token_id: the id written at padded positions.
        eos_token_id: one end id, several, or None.
        log_probs: also return the sampler's log-probs of the response tokens.
        greedy: decode greedily instead of sampling.

    Returns:
        The ``Rollout``: (B, P+R) int64 sequences and attention mask, (B, R) bool action mask and,
        with ``log_probs``, (B, R) float32 log-probs; R <= ``params.max_new_tokens``.

    Raises:
        ValueError: if ``prompts`` is empty or a prompt has no token.
    """
    from transformers import LogitsProcessorList

    device = model_device(model)
    input_ids, prompt_mask = left_pad(prompts, pad_token_id)
    input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
    recorder = SampledLogProbs(params.temperature) if log_probs else None
    with _only_these_settings(model):
        sampling = {} if greedy else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        out = model.generate(
            input_ids=input_ids, attention_mask=prompt_mask, do_sample=not greedy,
            max_new_tokens=params.max_new_tokens, **sampling,
            pad_token_id=pad_token_id, eos_token_id=end_ids(eos_token_id) or None,
            logits_processor=LogitsProcessorList([recorder] if recorder else []),
        )
    prompt_len = input_ids.shape[1]
    action_mask = response_mask(out[:, prompt_len:], eos_token_id)
    attention_mask = torch.cat([prompt_mask, action_mask.long()], dim=1)
    sequences = out.masked_fill(attention_mask == 0, pad_token_id)
    sampled = recorder.result(out) * action_mask if recorder else None
    return Rollout(sequences, attention_mask, action_mask, prompt_len, log_probs=sampled)


class SampledLogProbs:
    """A logits processor (transformers' ``LogitsProcessor`` protocol) that keeps, at each step,
    the log-prob of the token sampled at the step before, as ``action_log_probs`` computes it
    (``log_probs_from_logits`` of the logits / temperature): it sees the raw logits (it is the first
    processor once ``_only_these_settings`` holds, and temperature, top-k and top-p come after
    every caller's processor), and the sampled token is the last of the next step's ``input_ids``.
    Holds one (B, V) row of logits at a time, not every step's.

    Args:
        temperature: the sampling temperature the logits are divided by.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._last: torch.Tensor | None = None  # (B, V) logits / T of the step whose token is not yet known
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._keep(input_ids[:, -1])
        self._last = scores.float() / self.temperature  # a new tensor: later processors cannot change it
        return scores

    def _keep(self, tokens: torch.Tensor) -> None:
        if self._last is not None:
            self._steps.append(log_probs_from_logits(self._last, tokens))
            self._last = None

    def result(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, R) log-probs of the last R tokens of ``sequences``, R = the number of steps sampled.

        Args:
            sequences: (B, P+R) int64 tensor, the output of ``generate``.

        Returns:
            (B, R) float32 tensor.
        """
        self._keep(sequences[:, -1])
        return torch.stack(self._steps, dim=1)


@contextlib.contextmanager
def _only_these_settings(model: nn.Module):
    """Inside, ``model.generate`` sees the checkpoint's generation_config.json with every setting of
    ``_PROCESSOR_SETTINGS`` neutral (transformers fills each setting a call leaves unset from that
    file, and a repetition penalty there, say, would change the distribution that PPO's log-probs
    describe). Warns once for each checkpoint's settings so left out."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its HF model
    saved = getattr(hf, "generation_config", None)
    if saved is None:
        yield
        return
    dropped = ", ".join(f"{k}={getattr(saved, k)!r}" for k, neutral in _PROCESSOR_SETTINGS.items()
                        if getattr(saved, k, None) not in (None, neutral))
    if dropped and dropped not in _told:
        _told.add(dropped)
        logger.warning("the checkpoint's generation settings %s are not applied: responses are sampled with "
                       "maker.temperature, maker.top_k and maker.top_p only, the distribution PPO's log-probs "
                       "describe", dropped)
    neutral = copy.deepcopy(saved)
    for key, value in _PROCESSOR_SETTINGS.items():
        setattr(neutral, key, value)
    hf.generation_config = neutral
    try:
        yield
    finally:
        hf.generation_config = saved

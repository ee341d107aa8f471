"""Factories over Hugging Face ``transformers`` Auto classes.

Shapes: B = batch, T = sequence length (left-padded prompt + right-padded response),
R = number of response tokens ("actions"), V = vocabulary size.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ray_ppo.config.choices import DTYPES as DTYPE_NAMES
from ray_ppo.models.packing import Layout, keeps_logits, packed_log_probs, packed_values, packs
from ray_ppo.models.quiet import quiet_transformers
from ray_ppo.models.tiny import resolve_pretrained

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
VALUE_HEAD_FILE = "value_head.safetensors"

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""Rule reward: ``fn(prompts, responses) -> one float per response`` (decoded text, special tokens removed)."""


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error on unknown names.

    Args:
        name: a dtype name of ``DTYPES``, e.g. "float32".

    Returns:
        The torch dtype.

    Raises:
        ValueError: if ``name`` is not in ``DTYPES``.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def dtype_kwargs(dtype: str) -> dict:
    """``from_pretrained`` keyword for the weights' dtype: ``dtype`` since transformers 4.56,
    ``torch_dtype`` before (ColossalAI pins transformers 4.51.3).

    Args:
        dtype: a dtype name of ``DTYPES``.

    Returns:
        A one-key dict of keyword arguments for ``from_pretrained``.

    Raises:
        ValueError: if ``dtype`` is not in ``DTYPES``.
    """
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch_dtype(dtype)}


def load_tokenizer(path: str):
    """Tokenizer for generation: left padding, and a pad token (the EOS token if it has none).

    Args:
        path: a checkpoint directory, hub name or tiny-model name (``resolve_pretrained``).

    Returns:
        The ``transformers`` tokenizer.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_actor(path: str, dtype: str = "float32") -> nn.Module:
    """Causal LM for the actor (policy) or the reference model.

    Args:
        path: a checkpoint directory, hub name or tiny-model name (``resolve_pretrained``).
        dtype: the weights' dtype name (``DTYPES``).

    Returns:
        The ``AutoModelForCausalLM`` model.
    """
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(resolve_pretrained(path), **dtype_kwargs(dtype))


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability of ``model`` to 0, in place.

    PPO's ratio compares the policy that sampled (no dropout) with the policy being updated; a
    dropout mask in the update alone would bias it. LoRA adapters applied afterwards keep their
    own ``model.lora.dropout``.

    Args:
        model: the model to change.

    Returns:
        ``model`` itself.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at the first real token of each row.

    Args:
        attention_mask: (B, T) 0/1 int or bool tensor, 1 on real tokens.

    Returns:
        (B, T) int64 positions (0 on the left padding too).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def action_logits(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                  temperature: float = 1.0) -> torch.Tensor:
    """Logits (B, R, V) that predict the last ``num_actions`` tokens of ``sequences``, divided by
    the sampling temperature so they describe the distribution the tokens were sampled from.

    Args:
        model: a causal LM.
        sequences: (B, T) int64 token ids, left-padded prompt then right-padded response.
        attention_mask: (B, T) 0/1 int tensor, 1 on real tokens.
        num_actions: R, the number of response tokens at the end of each row.
        temperature: the sampling temperature the logits are divided by.

    Returns:
        (B, R, V) float32 tensor; row t predicts response token t.
    """
    keep = {"logits_to_keep": num_actions + 1} if keeps_logits(model) else {}  # no vocabulary-wide logits for the prompt
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, **keep)
    logits = out.logits[:, -num_actions - 1:-1].float()
    return logits / temperature if temperature != 1.0 else logits


def action_log_probs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                     temperature: float = 1.0) -> torch.Tensor:
    """Log-probs (B, R) of the response tokens under ``model``: one packed pass where the model
    ``packs`` (``ray_ppo.models.packing``), else a padded one.

    Args:
        model: a causal LM.
        sequences: (B, T) int64 token ids, left-padded prompt then right-padded response.
        attention_mask: (B, T) 0/1 int tensor, 1 on real tokens.
        num_actions: R, the number of response tokens at the end of each row.
        temperature: the sampling temperature the logits are divided by.

    Returns:
        (B, R) float32 tensor of log-probs (padded response positions: 0 when packed, unspecified
        when padded; mask them).
    """
    return action_log_probs_and_entropy(model, sequences, attention_mask, num_actions, temperature)[0]


def action_log_probs_and_entropy(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                                 num_actions: int, temperature: float = 1.0,
                                 entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``action_log_probs`` and, with ``entropy``, the (B, R) entropy of each response position's
    distribution, from the same pass.

    Args:
        model: a causal LM.
        sequences: (B, T) int64 token ids, left-padded prompt then right-padded response.
        attention_mask: (B, T) 0/1 int tensor, 1 on real tokens.
        num_actions: R, the number of response tokens at the end of each row.
        temperature: the sampling temperature the logits are divided by.
        entropy: also compute the entropies.

    Returns:
        ((B, R) float32 log-probs, (B, R) float32 entropies or None); mask the padded positions.
    """
    from ray_ppo.algo import entropy_from_logits, log_probs_from_logits

    if packs(model):
        return packed_log_probs(model, Layout.of(sequences, attention_mask, num_actions), temperature, entropy)
    logits = action_logits(model, sequences, attention_mask, num_actions, temperature)
    return (log_probs_from_logits(logits, sequences[:, -num_actions:]),
            entropy_from_logits(logits) if entropy else None)


class Critic(nn.Module):
    """Value model: a transformer backbone (``AutoModel``) plus a scalar value head.

    ``forward`` returns per-token values (B, T); the value of response token t is read at the
    position that predicts it, like the actor's logits (see ``action_values``).

    Args:
        backbone: a transformer without an LM head (``AutoModel``) whose config has ``hidden_size``.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (backbone.config.hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token values.

        Args:
            input_ids: (B, T) int64 token ids.
            attention_mask: (B, T) 0/1 int tensor, 1 on real tokens; None for a packed row (``Layout``).
            position_ids: (B, T) int64 positions; None: counted from ``attention_mask``.

        Returns:
            (B, T) float32 tensor, the value read at every position.
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32") -> "Critic":
        """Backbone from any causal-LM or base checkpoint; value head from ``value_head.safetensors`` if present.

        Args:
            path: a checkpoint directory, hub name or tiny-model name (``resolve_pretrained``).
            dtype: the weights' dtype name (``DTYPES``).

        Returns:
            The critic (a freshly initialised head where the checkpoint has none).
        """
        from safetensors.torch import load_file
        from transformers import AutoModel

        quiet_transformers()
        path = resolve_pretrained(path)
        critic = cls(AutoModel.from_pretrained(path, **dtype_kwargs(dtype)))
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.exists():
            critic.value_head.load_state_dict(load_file(str(head_file)))
        return critic

    def save_pretrained(self, directory: str | Path) -> None:
        """Backbone with ``save_pretrained`` (safetensors) and the head in ``value_head.safetensors``.

        Args:
            directory: where to write the files.
        """
        from safetensors.torch import save_file

        self.backbone.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()}, str(Path(directory) / VALUE_HEAD_FILE))


def action_values(critic: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
    """Values (B, R), in float32, of the states in which each response token was chosen: one
    packed pass where the critic ``packs`` (``ray_ppo.models.packing``), else a padded one.

    Args:
        critic: a value model whose ``forward(sequences, attention_mask)`` gives (B, T) values (``Critic``).
        sequences: (B, T) int64 token ids, left-padded prompt then right-padded response.
        attention_mask: (B, T) 0/1 int tensor, 1 on real tokens.
        num_actions: R, the number of response tokens at the end of each row.

    Returns:
        (B, R) float32 tensor (padded response positions: 0 when packed, unspecified when padded).
    """
    if packs(critic):
        return packed_values(critic, Layout.of(sequences, attention_mask, num_actions))
    return critic(sequences, attention_mask)[:, -num_actions - 1:-1].float()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index (B,) of the last attended token of each row (works for left and right padding).

    Args:
        attention_mask: (B, T) 0/1 int or bool tensor, 1 on real tokens.

    Returns:
        (B,) int64 column indices.
    """
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


class RewardModel(nn.Module):
    """Sequence classifier with one label; the score is read at the last non-pad token.

    The last token is found from the attention mask rather than from the pad id, because many
    tokenizers use EOS as pad and a generated EOS is a real token.

    Args:
        model: an ``AutoModelForSequenceClassification`` with one label.

    Raises:
        ValueError: if ``model`` has no ``score`` or ``classifier`` head.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.head = next((getattr(model, n) for n in ("score", "classifier") if hasattr(model, n)), None)
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no 'score' or 'classifier' head; "
                             "the reward model must be an AutoModelForSequenceClassification with num_labels=1")

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32") -> "RewardModel":
        """Load a sequence-classification checkpoint as a reward model.

        Args:
            path: a checkpoint directory, hub name or tiny-model name (``resolve_pretrained``).
            dtype: the weights' dtype name (``DTYPES``).

        Returns:
            The reward model.

        Raises:
            ValueError: if the checkpoint does not have exactly one label, or has no score head.
        """
        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        model = AutoModelForSequenceClassification.from_pretrained(resolve_pretrained(path), **dtype_kwargs(dtype))
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {path!r} has num_labels={model.config.num_labels}; it needs exactly 1")
        return cls(model)

    @torch.no_grad()
    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The score of each sequence, without gradients.

        Args:
            sequences: (B, T) int64 token ids, left-padded prompt then right-padded response.
            attention_mask: (B, T) 0/1 int tensor, 1 on real tokens.

        Returns:
            (B,) float32 tensor of scores.
        """
        hidden = self.model.base_model(input_ids=sequences, attention_mask=attention_mask,
                                       position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]
        return self.head(last).squeeze(-1).float()


def load_reward_fn(spec: str) -> RewardFn:
    """Import a rule reward given as ``"package.module:function"``.

    Args:
        spec: ``"package.module:function"``.

    Returns:
        The function (a ``RewardFn``).

    Raises:
        ValueError: if ``spec`` is malformed, cannot be imported, or names no callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward function {spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn

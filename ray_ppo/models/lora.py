"""LoRA through ``peft``: adapters on the actor (and optionally the critic backbone).

With LoRA the reference model is the actor with its adapters disabled, not a second copy of
the weights. Makers keep the adapters *live* (not merged): a push replaces the adapter tensors,
so a maker always holds exactly ``W0 + scale * B @ A`` of the latest push — never a sum of
deltas — and the base ``W0`` is never modified.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn


def lora_config(rank: int, alpha: float, dropout: float, target_modules: Iterable[str] | None, task_type: str | None):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=list(target_modules) if target_modules else None, task_type=task_type)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: Iterable[str] | None = None, task_type: str | None = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` with fresh LoRA adapters; only the adapters stay trainable.

    ``target_modules=None`` uses peft's default for the architecture (``c_attn`` for GPT-2,
    ``q_proj``/``v_proj`` for Llama-style models).
    """
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(rank, alpha, dropout, target_modules, task_type))
    except ValueError as e:
        raise ValueError(f"cannot apply LoRA (model.lora.target_modules={target_modules}): {e}") from e


def trainable_names(model: nn.Module) -> set[str]:
    """State-dict names of the trainable parameters (adapters, value head)."""
    return {name for name, p in model.named_parameters() if p.requires_grad}

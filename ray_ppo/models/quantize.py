"""Quantized copies of a policy for generation on makers (``maker.quantization``).

The maker keeps its float model: pushes load into it, and a fresh quantized copy is made after
each push. The quantized copy both samples the responses and scores their log-probs, so the
behaviour log-probs PPO's ratio divides by are those of the policy that really sampled.

On CPU, ``int8`` is PyTorch's dynamic quantization: ``nn.Linear`` weights stored as int8,
activations quantized on the fly. GPT-2's ``Conv1D`` layers are turned into ``nn.Linear`` first
so they are quantized too. LoRA adapters are merged into the copy before quantizing.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from ray_ppo.config.choices import QUANTIZATIONS


def _conv1d_to_linear(module: nn.Module) -> None:
    """Replace transformers' ``Conv1D`` (weight stored in x out) by an equivalent ``nn.Linear``, in place."""
    for name, child in module.named_children():
        if type(child).__name__ == "Conv1D":
            linear = nn.Linear(child.weight.shape[0], child.weight.shape[1], dtype=child.weight.dtype)
            linear.weight.data.copy_(child.weight.data.t())
            linear.bias.data.copy_(child.bias.data)
            setattr(module, name, linear)
        else:
            _conv1d_to_linear(child)


def quantize_for_generation(model: nn.Module, method: str = "int8") -> nn.Module:
    """A quantized copy of ``model`` (float32, on CPU) for sampling; ``model`` is not modified."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown maker.quantization {method!r}; choose one of {QUANTIZATIONS}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("maker.quantization=int8 uses PyTorch dynamic quantization, which runs on CPU only; "
                         "on GPU makers use model.dtype=bfloat16 instead")
    clone = copy.deepcopy(model)
    if hasattr(clone, "merge_and_unload"):  # peft: fold the adapters into the copy's weights
        clone = clone.merge_and_unload()
    clone = clone.float().eval()
    _conv1d_to_linear(clone)
    with warnings.catch_warnings():  # torch.ao dynamic quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(clone, {nn.Linear}, dtype=torch.qint8)

"""Training strategies: how models are wrapped, stepped and gathered on the trainer side.

A strategy is any object with the ``Strategy`` protocol's methods. The PPO loop calls only
these, so DDP, FSDP2 and ColossalAI (``train/colossalai_strategy.py``) plug in without forking the loop.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Strategy(Protocol):
    """What the PPO learner needs from a distributed training strategy."""

    name: str

    def wrap(self, model: nn.Module) -> nn.Module:
        """Prepare a model for training (move to device, wrap for data parallelism)."""

    def make_optimizer(self, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """Optimizer over the wrapped model's trainable parameters."""

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Backpropagate ``loss``."""

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip gradients to ``max_norm`` (0 = no clipping) and return the total norm before clipping."""

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Apply and zero the gradients."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective on every rank: the full, unsharded state dict on CPU on rank 0, ``{}`` elsewhere.
        Its tensors are copies, never views of the live weights: a push reads them in a background
        thread while the next step trains (``ray_ppo.train.loop._publish``)."""

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Collective on every rank: the full optimizer state on rank 0, ``{}`` elsewhere."""

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a full optimizer state (as ``full_optimizer_state_dict`` returned it on rank 0) on every rank."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper."""


FUSED_DEVICES = ("cpu", "cuda")
"""Where torch's fused AdamW kernel runs (torch >= 2.4 on the CPU). There torch's default is a
loop of several kernels per tensor (its ``foreach`` kernels are for GPUs): the fused kernel takes
SmolLM2-135M's step from 671 to 172 ms on one thread (benchmarks/optimizer_step.py), weights equal
to float rounding. A run resumed from a checkpoint keeps the optimizer options it was saved with
(torch's ``load_state_dict``)."""


def _adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable weights, fused where every weight is a float on a CPU or GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def _cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class LocalStrategy:
    """One process, no wrapping: the synchronous local loop and unit tests."""

    name = "local"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def make_optimizer(self, model, lr, weight_decay):
        return _adamw(model, lr, weight_decay)

    def backward(self, loss, model, optimizer):
        loss.backward()

    def clip_grad_norm(self, model, optimizer, max_norm):
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(norm)

    def step(self, optimizer, model):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, model):
        return _cpu_state_dict(self.unwrap(model))

    def full_optimizer_state_dict(self, model, optimizer):
        return optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state):
        optimizer.load_state_dict(state)

    def unwrap(self, model):
        return model


class DDPStrategy(LocalStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` over the process group Ray Train set up."""

    name = "ddp"

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def full_state_dict(self, model):
        return _cpu_state_dict(self.unwrap(model)) if torch.distributed.get_rank() == 0 else {}

    def full_optimizer_state_dict(self, model, optimizer):
        return optimizer.state_dict() if torch.distributed.get_rank() == 0 else {}

    def unwrap(self, model):
        return model.module


def _block_classes(model: nn.Module) -> set[str]:
    """Names of the transformer block classes (``_no_split_modules`` of HF models)."""
    for candidate in (model, getattr(model, "backbone", None)):
        names = getattr(candidate, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


class FSDPStrategy(LocalStrategy):
    """PyTorch FSDP2 (``fully_shard``, ZeRO-3 style): each transformer block is a shard unit."""

    name = "fsdp"

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (torch.distributed.get_world_size(),))
        blocks = _block_classes(model)
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def clip_grad_norm(self, model, optimizer, max_norm):
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return state if torch.distributed.get_rank() == 0 else {}

    def full_optimizer_state_dict(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        return state if torch.distributed.get_rank() == 0 else {}

    def load_optimizer_state(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def make_strategy(name: str, device: str | torch.device = "cpu", max_grad_norm: float = 1.0) -> Strategy:
    """Strategy by its ``trainer.strategy`` name; ``colossalai_*`` names import colossalai here, and only here.

    ``max_grad_norm`` matters only to ColossalAI's ZeRO/Gemini plugins, which clip inside their
    own step at a threshold fixed when the plugin is built.
    """
    if name.startswith("colossalai_"):
        from ray_ppo.train.colossalai_strategy import ColossalAIStrategy

        return ColossalAIStrategy(name, device, max_grad_norm)
    strategies = {"local": LocalStrategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy}
    if name not in strategies:
        raise ValueError(f"unknown trainer.strategy {name!r}; choose one of {sorted(strategies)}")
    return strategies[name](device)

"""ColossalAI strategies (the optional extra ``ray_ppo[colossalai]``, CUDA only).

``colossalai_zero2`` (LowLevelZero stage 2), ``colossalai_zero2_cpu`` (the same with the fp32
master weights and optimizer state in CPU memory), ``colossalai_gemini`` (Gemini, parameters
sharded ZeRO-3 style on the GPU) and ``colossalai_gemini_cpu`` (Gemini with parameters and
optimizer state offloaded to CPU), each through ColossalAI's ``Booster`` with ``HybridAdam``,
bf16 mixed precision and the plugin's own gradient clipping. The placements follow the reference
design's ``get_strategy_from_args`` ("cuda" and "cpu" Gemini placements are ``static`` with
``shard_param_frac=1`` and no / full offload in ColossalAI 0.5).

This module imports colossalai; ``ray_ppo.train.strategies.make_strategy`` imports it only when such a
strategy is chosen. Written against ColossalAI 0.5.0 (its pins: torch<=2.5.1,
transformers==4.51.3, peft<=0.13.2); ``make test-colossalai`` tests it in that environment.
HybridAdam builds its CPU and CUDA kernels on first use unless colossalai was installed with
``BUILD_EXT=1``: either way the CUDA toolkit (``CUDA_HOME``, an nvcc matching torch's CUDA) is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

try:
    from colossalai.accelerator import get_accelerator, set_accelerator
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
    from colossalai.booster.plugin.plugin_base import Plugin
    from colossalai.interface import ModelWrapper, OptimizerWrapper
    from colossalai.nn.optimizer import HybridAdam
    from colossalai.zero import GeminiDDP, GeminiOptimizer, LowLevelZeroOptimizer
    from colossalai.zero.low_level._utils import calculate_global_norm_from_list
except ImportError as e:
    raise ImportError(
        f"the colossalai_* strategies need the colossalai package ({e}); "
        f"pip install 'ray_ppo[colossalai]' on a CUDA machine, or use trainer.strategy=fsdp"
    ) from e

PRECISION = "bf16"
"""Mixed precision of every plugin: bf16 needs no loss scaling, so a non-finite gradient norm
always means a bad update (which the learner skips) rather than a loss-scale overflow."""


@dataclass(frozen=True)
class Recipe:
    """How a strategy boosts a model: ``plugin(precision, max_norm)`` and the optimizer class
    (called with ``params, lr=, weight_decay=``)."""

    plugin: Callable[[str, float], Plugin]
    optimizer: Callable[..., torch.optim.Optimizer] = HybridAdam


RECIPES: dict[str, Recipe] = {
    "colossalai_zero2": Recipe(lambda precision, max_norm: LowLevelZeroPlugin(
        stage=2, precision=precision, max_norm=max_norm)),
    "colossalai_zero2_cpu": Recipe(lambda precision, max_norm: LowLevelZeroPlugin(
        stage=2, precision=precision, max_norm=max_norm, cpu_offload=True)),
    "colossalai_gemini": Recipe(lambda precision, max_norm: GeminiPlugin(
        placement_policy="static", shard_param_frac=1.0, precision=precision, max_norm=max_norm)),
    "colossalai_gemini_cpu": Recipe(lambda precision, max_norm: GeminiPlugin(
        placement_policy="static", shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0,
        precision=precision, max_norm=max_norm)),
}


class BoostedModule(nn.Module):
    """What ``wrap`` returns: the user's module until ``make_optimizer`` boosts it together with its
    optimizer (a Booster boosts the pair at once), the boosted model afterwards. Calls go to
    whichever ``module`` holds, so the learner keeps the object ``wrap`` gave it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.booster: Booster | None = None
        self.dtypes = {name: t.dtype for name, t in module.state_dict().items()}
        """Dtypes before boosting (the plugins cast to bf16): full state dicts are returned in them."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class BoostedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over a boosted optimizer (a ColossalAI ``OptimizerWrapper``, which
    is not one): LR schedulers need a real Optimizer, and the ``param_groups`` they write ``lr`` into
    are the wrapped optimizer's own group dicts. ``step`` and ``zero_grad`` go to the boosted one."""

    def __init__(self, boosted: OptimizerWrapper):
        inner = boosted.optim
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups, self.state = inner.param_groups, inner.state
        self.boosted = boosted
        self.pending = False
        """True between a backward and the step that applies its gradients."""

    def step(self, closure=None):
        self.pending = False
        return self.boosted.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients. Dropping those of a backward that no step applied (the learner skips
        non-finite updates) also resets ZeRO's and Gemini's reduced-gradient state: their step's own
        overflow branch does that (Gemini's also restores the bf16 chunks the gradients were written into)."""
        if self.pending and isinstance(self.boosted, (LowLevelZeroOptimizer, GeminiOptimizer)):
            _skipped_step(self.boosted)
        else:
            self.boosted.zero_grad(set_to_none=set_to_none)
        self.pending = False


class ColossalAIStrategy:
    """A ``Strategy`` over ColossalAI's Booster.

    Responsibilities:
      - ``wrap`` defers: ``make_optimizer`` builds the optimizer, boosts (model, optimizer) with a
        fresh Booster, swaps the boosted model into the ``BoostedModule`` and returns a
        ``BoostedOptimizer``;
      - ``backward`` is ``booster.backward``;
      - ``clip_grad_norm`` returns the pre-clip gradient norm; ZeRO and Gemini clip inside their
        own step at the ``max_grad_norm`` the plugin was built with, so a different ``max_norm`` is
        an error; a skipped update (``zero_grad`` instead of ``step``) goes through the plugin's
        own overflow branch;
      - full state dicts (rank 0, CPU, the user's dtypes; values of the bf16 working weights, as
        ColossalAI's own checkpoints hold them) and full optimizer states, both collectives.
    """

    def __init__(self, name: str, device: str | torch.device = "cuda", max_grad_norm: float = 1.0,
                 recipe: Recipe | None = None):
        """``recipe`` replaces the one of ``name`` (tests run the Booster on CPU with one)."""
        if recipe is None and name not in RECIPES:
            raise ValueError(f"unknown ColossalAI strategy {name!r}; choose one of {sorted(RECIPES)}")
        self.name, self.device, self.max_grad_norm = name, torch.device(device), max_grad_norm
        self.recipe = recipe or RECIPES[name]
        if recipe is None:
            _check_cuda(name, self.device)

    @classmethod
    def torch_ddp_on_cpu(cls, max_grad_norm: float = 1.0) -> "ColossalAIStrategy":
        """For tests only: ColossalAI's ``TorchDDPPlugin`` with torch ``AdamW`` on CPU (gloo), which
        runs this class's Booster wiring without CUDA. Sets ColossalAI's process-wide accelerator
        to "cpu" (HybridAdam's kernels and the ZeRO/Gemini plugins assert CUDA)."""
        set_accelerator("cpu")
        recipe = Recipe(lambda precision, max_norm: TorchDDPPlugin(), torch.optim.AdamW)
        return cls("colossalai_torch_ddp_cpu", "cpu", max_grad_norm, recipe)

    def wrap(self, model: nn.Module) -> BoostedModule:
        return BoostedModule(model)

    def make_optimizer(self, model: BoostedModule, lr: float, weight_decay: float) -> BoostedOptimizer:
        params = [p for p in model.module.parameters() if p.requires_grad]
        optimizer = self.recipe.optimizer(params, lr=lr, weight_decay=weight_decay)
        booster = Booster(plugin=self.recipe.plugin(PRECISION, self.max_grad_norm or math.inf))
        boosted_model, boosted_optimizer, *_ = booster.boost(model.module, optimizer)
        model.module, model.booster = boosted_model, booster
        return BoostedOptimizer(boosted_optimizer)

    def backward(self, loss: torch.Tensor, model: BoostedModule, optimizer: BoostedOptimizer) -> None:
        model.booster.backward(loss, optimizer.boosted)
        optimizer.pending = True

    def clip_grad_norm(self, model: BoostedModule, optimizer: BoostedOptimizer, max_norm: float) -> float:
        if max_norm != self.max_grad_norm:
            raise ValueError(
                f"trainer.strategy={self.name!r} clips inside the optimizer step at max_grad_norm="
                f"{self.max_grad_norm}, fixed when the plugin was built, but was asked for {max_norm}; "
                f"build the strategy with max_grad_norm={max_norm}")
        return _grad_norm(optimizer.boosted, max_norm)

    def step(self, optimizer: BoostedOptimizer, model: BoostedModule) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, model: BoostedModule) -> dict[str, torch.Tensor]:
        inner = model.module
        if isinstance(inner, GeminiDDP):  # gathers the chunks
            state = inner.state_dict(only_rank_0=True)
        else:  # LowLevelZero (stage 2 keeps full working weights on every rank), DDP, or not boosted yet
            state = self.unwrap(model).state_dict()
        if dist.get_rank() != 0:
            return {}
        return {k: v.detach().to("cpu", dtype=model.dtypes.get(k, v.dtype), copy=True) for k, v in state.items()}

    def full_optimizer_state_dict(self, model: BoostedModule, optimizer: BoostedOptimizer) -> dict:
        boosted = optimizer.boosted
        if isinstance(boosted, LowLevelZeroOptimizer):
            state = boosted.state_dict(only_on_master=True)
        elif isinstance(boosted, GeminiOptimizer):
            state = boosted.state_dict(only_rank_0=True)
        else:
            state = boosted.state_dict()
        return state if dist.get_rank() == 0 else {}

    def load_optimizer_state(self, model: BoostedModule, optimizer: BoostedOptimizer, state: dict) -> None:
        optimizer.boosted.load_state_dict(state)  # ZeRO and Gemini keep this rank's part of the full state

    def unwrap(self, model: BoostedModule) -> nn.Module:
        """The user's module. Under Gemini its parameters live in chunks: read them with ``full_state_dict``."""
        inner = model.module
        return inner.unwrap(unwrap_peft=False) if isinstance(inner, ModelWrapper) else inner


def _check_cuda(name: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"trainer.strategy={name!r} runs on CUDA only (device {device}); "
                         f"use trainer.strategy=fsdp or ddp")
    if not torch.cuda.is_bf16_supported():
        raise ValueError(f"trainer.strategy={name!r} trains in bf16, which this GPU does not support; "
                         f"use trainer.strategy=fsdp or ddp")
    torch.cuda.set_device(device)  # the plugins place everything on ColossalAI's current device


def _skipped_step(optimizer: LowLevelZeroOptimizer | GeminiOptimizer) -> None:
    """The optimizer's step through its overflow branch, which drops the gradients and updates nothing."""
    mixin = (optimizer.mixed_precision_mixin if isinstance(optimizer, LowLevelZeroOptimizer)
             else optimizer.mix_precision_mixin)
    mixin.should_skip_step = lambda: True  # shadows the method on this instance only
    try:
        optimizer.step()
    finally:
        del mixin.should_skip_step


def _grad_norm(optimizer: OptimizerWrapper, max_norm: float) -> float:
    """Total gradient norm before clipping. ZeRO and Gemini compute it again (and clip) in step()."""
    if isinstance(optimizer, LowLevelZeroOptimizer):
        return _low_level_zero_grad_norm(optimizer)
    if isinstance(optimizer, GeminiOptimizer):
        return _gemini_grad_norm(optimizer)
    return float(optimizer.clip_grad_by_norm(max_norm if max_norm > 0 else math.inf))


def _low_level_zero_grad_norm(optimizer: LowLevelZeroOptimizer) -> float:
    """The norm ``LowLevelZeroOptimizer.step`` computes from this rank's reduced gradient partitions."""
    norms = []
    for group_id in range(optimizer.num_param_groups):
        norms.append(sum(optimizer._compute_grad_norm(dp_pg=store.torch_pg,
                                                      gradients=store.get_working_grads_by_group_id(group_id))
                         for store in optimizer.pg_to_grad_store.values()))
    return float(calculate_global_norm_from_list(norm_list=norms))


def _gemini_grad_norm(optimizer: GeminiOptimizer) -> float:
    """``GeminiOptimizer._calc_global_norm`` without consuming the per-chunk norms its step() reads."""
    reuse_fp16_chunk = optimizer.module.chunk_manager.reuse_fp16_chunk
    norm_sqr, partial = 0.0, {}
    for chunk in optimizer.chunk16_set:
        grad_chunk = chunk if reuse_fp16_chunk else chunk.grad_chunk
        if grad_chunk.is_gathered:
            norm_sqr += grad_chunk.l2_norm
        else:
            partial[grad_chunk.torch_pg] = partial.get(grad_chunk.torch_pg, 0.0) + grad_chunk.l2_norm
    for group, part in partial.items():
        t = torch.tensor([part], dtype=torch.float32, device=get_accelerator().get_current_device())
        dist.all_reduce(t, group=group)
        norm_sqr += t.item()
    return math.sqrt(norm_sqr)

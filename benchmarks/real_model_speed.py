"""Where a step of the SmolLM2 GRPO run goes on this machine, and what more trainer threads or no reference model buy.

    python benchmarks/real_model_speed.py                       # the variants below, 240 s of training each
    python benchmarks/real_model_speed.py --variants base bf16 bf16_threads2 --budget 180 --tag bf16
    python benchmarks/real_model_speed.py --variants base threads2 --budget 120
    python benchmarks/real_model_speed.py --variants base interpolate --tag proximal

Each variant is one ``ray-ppo train --config configs/smollm2_grpo.yaml`` (one maker, one trainer
worker, GRPO on SmolLM2-135M-Instruct, 32 responses a step) with evaluation off and
``trainer.time_budget_s=--budget``, plus its overrides:

  base        as shipped: one torch thread for the maker and one for the trainer worker, no KL term,
              so no reference model (``ppo.uses_reference`` false)
  reference   base with ``ppo.kl_coef=1e-9``: the maker loads the reference model and computes its
              log-probs every batch (the penalty is negligible), what every run paid before
              ``uses_reference``
  threads2    base with ``trainer.torch_threads=2``: the trainer, the slower side, gets the second
              core while the maker is idle (3 threads on 2 cores while it is not)
  threads2_reference  threads2 with the reference model
  bf16        base in bfloat16: ``trainer.autocast=true`` (float32 weights, bfloat16 compute) and
              ``maker.dtype=bfloat16`` (the maker's weights), for CPUs with AMX
  bf16_threads2  bf16 with ``trainer.torch_threads=2``
  interpolate base with ``ppo.proximal=interpolate``: no proximal forward pass over the step's
              second minibatch (AReaL's approximation, docs/estimators.md)
  padded      base with ``model.packing=false``: every pass padded to the batch's longest prompt
              plus its longest answer, each prompt computed once per answer (docs/packing.md)
  padded_bf16 bf16 with ``model.packing=false``

The table reads each run's ``metrics.jsonl`` from its 4th step on (its first steps wait for the
first batches): steady samples/s (trained responses over the steps' wall time), the trainer's
mean ``train_s`` a step and idle share, the maker's mean ``maker_generate_s`` (its seconds making
experience between two steps: generation, scoring, the reference pass) and idle share, the
trainer's ``tokens_computed`` and ``tokens_trained`` a step and the optimizer's share of
``train_s`` (``optimizer_s``; docs/metrics.md). The variants run
one after another, in the order given, on an otherwise idle machine; ``benchmarks/real_model.py``'s
``--variants ours trl`` gives TRL's samples/s on the same work.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from _common import ROOT, publish

CONFIG = ROOT / "configs" / "smollm2_grpo.yaml"
VARIANTS = {
    "base": [],
    "reference": ["ppo.kl_coef=1e-9"],
    "threads2": ["trainer.torch_threads=2"],
    "threads2_reference": ["trainer.torch_threads=2", "ppo.kl_coef=1e-9"],
    "bf16": ["trainer.autocast=true", "maker.dtype=bfloat16"],
    "bf16_threads2": ["trainer.autocast=true", "maker.dtype=bfloat16", "trainer.torch_threads=2"],
    "interpolate": ["ppo.proximal=interpolate"],
    "padded": ["model.packing=false"],
    "padded_bf16": ["model.packing=false", "trainer.autocast=true", "maker.dtype=bfloat16"],
}
SKIP_STEPS = 3
"""Steps left out at the start of a run: the trainer's first steps wait for the first batches."""


def run(name: str, out: Path, budget_s: float) -> None:
    subprocess.run([sys.executable, "-m", "ray_ppo.cli", "train", "--config", str(CONFIG), "--output", str(out),
                    "--overwrite", "eval.path=null", f"trainer.time_budget_s={budget_s}", "logging.progress=false",
                    *VARIANTS[name]], cwd=ROOT, check=True)


def steady(out: Path, batch: int) -> list:
    """samples/s, trainer train_s and idle share, maker busy s and idle share, tokens computed and
    trained, optimizer share, over the steps after ``SKIP_STEPS``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[SKIP_STEPS - 1], rows[-1]
    kept = rows[SKIP_STEPS:]
    mean = lambda key: sum(r[key] for r in kept) / len(kept)  # noqa: E731
    return [len(rows), batch * len(kept) / (last["elapsed_s"] - first["elapsed_s"]), mean("train_s"),
            mean("trainer_idle_ratio"), mean("maker_generate_s"), mean("maker_idle_ratio"), mean("tokens_computed"),
            mean("tokens_trained"), mean("optimizer_s") / mean("train_s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of training a variant")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "real_model_speed")
    parser.add_argument("--tag", default="", help="results go to real_model_speed_TAG.json (a second table beside the first)")
    args = parser.parse_args()
    rows = []
    for name in args.variants:
        out = args.output / (f"{name}_{args.tag}" if args.tag else name)
        run(name, out, args.budget)
        batch = yaml.safe_load((out / "config.yaml").read_text())["trainer"]["train_batch_size"]
        rows.append([name, " ".join(VARIANTS[name]) or "(as shipped)", *steady(out, batch)])
        headers = ["variant", "overrides", "steps", "samples/s", "trainer train_s", "trainer idle", "maker busy s",
                   "maker idle", "tokens computed", "tokens trained", "optimizer share"]
        publish(f"real_model_speed_{args.tag}" if args.tag else "real_model_speed", headers, rows, args=args)


if __name__ == "__main__":
    main()

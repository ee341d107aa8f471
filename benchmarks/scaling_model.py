"""Scaling model: project a 7B and a 70B detached PPO run on 8, 64 and 512 GPUs (docs/scaling.md).

    python benchmarks/scaling_model.py [--call-ms 2.0] [--items-per-call 32] [--put-gbs 6] [--stage-gbs 5]
                                       [--nic-gbs 12.5] [--nccl-gbs 25] [--startup-s 17.7]

No measurement here: arithmetic over inputs. The inputs measured on this machine (defaults;
benchmarks/README.md) are the coordinator's cost per call, rank 0's ``ray.put`` rate, a maker's
staging copy rate and the fixed start-up; the others are stated assumptions about the cluster
(NIC, NCCL bus bandwidth) and about the GPUs' generation and training rates (``MODELS``).
Half the GPUs make experience, half train. Each step trains ``GLOBAL_BATCH`` samples of
``PROMPT`` + ``RESPONSE`` tokens, and the weights are pushed after every step.
"""

from __future__ import annotations

import argparse
import math

from _common import publish

GLOBAL_BATCH = 512
PROMPT, RESPONSE = 512, 512
GPUS_PER_NODE = 8
MODELS = {
    # bytes pushed (actor + critic, bf16), GPUs per maker engine (tensor parallel), generated tokens/s per
    # GPU and trained tokens/s per GPU (assumed: vLLM-class decoding; PPO actor+critic at ~40% MFU of an H100)
    "7B": {"push_gb": 2 * 7e9 * 2 / 1e9, "tp": 1, "gen_tok_s": 2500.0, "train_tok_s": 4700.0},
    "70B": {"push_gb": 2 * 70e9 * 2 / 1e9, "tp": 8, "gen_tok_s": 800.0, "train_tok_s": 470.0},
}


def project(model: str, gpus: int, a) -> list:
    m = MODELS[model]
    maker_gpus = trainer_gpus = gpus // 2
    makers = max(1, maker_gpus // m["tp"])
    samples_s_gen = maker_gpus * m["gen_tok_s"] / RESPONSE
    samples_s_train = trainer_gpus * m["train_tok_s"] / (PROMPT + RESPONSE)
    samples_s = min(samples_s_gen, samples_s_train)
    step_s = GLOBAL_BATCH / samples_s
    calls_s = 2 * samples_s / a.items_per_call       # one send and one pull per batch of items
    coordinator_core = calls_s * a.call_ms / 1e3     # share of one core
    maker_nodes = max(1, math.ceil(maker_gpus / GPUS_PER_NODE))
    put_s = m["push_gb"] / a.put_gbs
    # Object store: every maker node pulls the whole push from rank 0's node (owner-bound), then each
    # maker engine copies it into its own staged tensors (pipelined with the transfer: the slower wins).
    store_s = put_s + max(m["push_gb"] * maker_nodes / a.nic_gbs, m["push_gb"] / a.stage_gbs)
    nccl_s = m["push_gb"] / a.nccl_gbs
    needed = math.ceil(store_s / step_s)              # ppo.max_staleness that keeps makers admitted during a push
    return [model, gpus, makers, f"{samples_s:,.0f}", f"{step_s:.1f}", f"{calls_s:,.0f}", f"{coordinator_core:.2f}",
            f"{m['push_gb']:.0f}", f"{store_s:.1f}", f"{nccl_s:.1f}", f"{max(step_s, store_s):.1f}",
            f"{max(step_s, nccl_s):.1f}", max(1, needed),
            "push (object store)" if store_s > step_s else ("coordinator" if coordinator_core > 0.5 else "none")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--call-ms", type=float, default=2.0, help="coordinator CPU per send or pull call (measured)")
    ap.add_argument("--items-per-call", type=int, default=32)
    ap.add_argument("--put-gbs", type=float, default=6.0, help="rank 0 ray.put rate (measured)")
    ap.add_argument("--stage-gbs", type=float, default=5.0, help="a maker's staging copy rate (measured)")
    ap.add_argument("--nic-gbs", type=float, default=12.5, help="object transfer out of rank 0's node (assumed 100 Gb/s)")
    ap.add_argument("--nccl-gbs", type=float, default=25.0, help="NCCL/RDT broadcast bus bandwidth (assumed)")
    ap.add_argument("--startup-s", type=float, default=17.7,
                    help="fixed start-up of fit() to the first trained step (benchmarks/startup.py: "
                         "17.7 s, tiny model, 2 cores, 2026-12-03)")
    a = ap.parse_args()
    rows = [project(model, gpus, a) for model in MODELS for gpus in (8, 64, 512)]
    print(f"Projection: {GLOBAL_BATCH} samples of {PROMPT}+{RESPONSE} tokens per step, push every step, "
          f"half the GPUs make experience; start-up {a.startup_s:g} s + model load not included\n")
    publish("scaling_model", ["model", "GPUs", "maker engines", "samples/s", "step s", "coordinator calls/s",
                 "coordinator core share", "GB per push", "push s (object store)", "push s (NCCL)",
                 "step s, push every step (object store)", "step s, push every step (NCCL)",
                 "max_staleness to hide an object-store push", "breaks first"], rows)


if __name__ == "__main__":
    main()

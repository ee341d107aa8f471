"""GPU check of the ColossalAI strategies: a short PPO training of a GPT-2-small-shaped actor and
critic (random weights, built from ``GPT2Config(n_layer=12, n_embd=768, n_head=12)``) with each
``colossalai_*`` strategy and ``fsdp``, and one table: step time, peak GPU memory, push time and bytes.

The trainer side of the detached pipeline without Ray (the lent GPU machine has none): one process
per strategy (world size 1, nccl), ``PPOLearner.train_step`` on synthetic experience batches, and a
push as rank 0 makes it minus the ``ray.put``: the full actor + critic state dict gathered by the
strategy and cut into ``sync.bucket_mb`` buckets. Each strategy runs in its own subprocess, so a
failure (a missing CUDA toolkit for HybridAdam's kernels, an out-of-memory) is reported in its row
and the others are still measured.

Usage: python scripts/gpu_check_colossalai.py [--steps N] [--strategies NAME ...]
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from ray_ppo.config.choices import COLOSSALAI_STRATEGIES

STRATEGIES = (*COLOSSALAI_STRATEGIES, "fsdp")
CHILD_TIMEOUT_S = 420
"""Per strategy: HybridAdam's first use may compile its CUDA kernels (minutes)."""
RESULT_TAG = "RESULT "
BATCH, MINI_BATCH, PROMPT_LEN, RESPONSE_LEN, BUCKET_MB = 16, 8, 64, 64, 64.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed train steps, after one warm-up step")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--child", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT_TAG + json.dumps(measure(args.child, args.steps)), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print(f"CUDA is missing (torch {torch.__version__}, no usable GPU): this check needs a CUDA machine; "
              f"nothing was run.")
        return 0
    print(versions(), flush=True)
    rows = [run_child(name, args.steps) for name in args.strategies]
    print_table(rows)
    return 0


def versions() -> str:
    import importlib.metadata

    import torch

    found = []
    for package in ("torch", "transformers", "peft", "colossalai"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} missing")
    return f"{torch.cuda.get_device_name(0)}; " + ", ".join(found)


def run_child(name: str, steps: int, timeout_s: float = CHILD_TIMEOUT_S, env: dict | None = None) -> dict:
    """Run ``measure(name)`` in a fresh process (environment ``env``, default this one's); its
    row, or the error it ended with."""
    command = [sys.executable, __file__, "--child", name, "--steps", str(steps)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"strategy": name, "error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [f"exit code {done.returncode}"]
    print(f"--- {name} failed; its stderr ends:\n" + "\n".join(done.stderr.splitlines()[-15:]), flush=True)
    return {"strategy": name, "error": tail[0][:160]}


def measure(name: str, steps: int) -> dict:
    """Build, train ``steps`` timed steps after a warm-up one, push once; the row of the table."""
    import torch

    from ray_ppo.config import Config
    from ray_ppo.models.sync import bucket_nbytes, make_buckets
    from ray_ppo.train.learner import PPOLearner
    from ray_ppo.train.strategies import make_strategy

    init_process_group()
    device = torch.device("cuda", 0)
    actor, critic = build_models()
    cfg = Config().with_overrides({"trainer.actor_lr": 1e-6, "trainer.critic_lr": 1e-6, "trainer.train_batch_size": BATCH,
                                   "trainer.mini_batch_size": MINI_BATCH, "trainer.ppo_epochs": 1,
                                   "trainer.total_steps": steps + 1})
    learner = PPOLearner(actor, critic, make_strategy(name, device), cfg, seed=0)
    torch.cuda.reset_peak_memory_stats(device)

    learner.train_step(synthetic_batch(actor.config.vocab_size, seed=0))
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
        metrics = learner.train_step(synthetic_batch(actor.config.vocab_size, seed=step + 1))
    torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - start) / steps

    start = time.perf_counter()
    state = {f"actor.{k}": v for k, v in learner.strategy.full_state_dict(learner.actor).items()}
    state.update({f"critic.{k}": v for k, v in learner.strategy.full_state_dict(learner.critic).items()})
    gather_s = time.perf_counter() - start
    push_bytes = sum(bucket_nbytes(bucket) for bucket in make_buckets(state, BUCKET_MB))
    push_s = time.perf_counter() - start
    return {"strategy": name, "step_s": step_s, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "gather_s": gather_s, "push_s": push_s, "push_mb": push_bytes / 2**20,
            "policy_loss": metrics["policy_loss"], "actor_grad_norm": metrics["actor_grad_norm"]}


def init_process_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1)


def build_models():
    """GPT-2 small shape (124 M parameters), random weights, dropout off as the pipelines build it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    from ray_ppo.models import Critic
    from ray_ppo.models.hf import disable_dropout

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12)
    return disable_dropout(GPT2LMHeadModel(config)), disable_dropout(Critic(GPT2Model(config)))


def synthetic_batch(vocab_size: int, seed: int):
    """BATCH samples of PROMPT_LEN + RESPONSE_LEN random tokens with made-up log-probs, values and advantages."""
    import torch

    from ray_ppo.algo import ExperienceBatch, ExperienceItem

    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(BATCH):
        log_probs = -torch.rand(RESPONSE_LEN, generator=g) * 4
        items.append(ExperienceItem(
            prompt_ids=torch.randint(1, vocab_size, (PROMPT_LEN,), generator=g),
            response_ids=torch.randint(1, vocab_size, (RESPONSE_LEN,), generator=g),
            action_log_probs=log_probs, ref_log_probs=log_probs.clone(),
            values=torch.randn(RESPONSE_LEN, generator=g), rewards=torch.zeros(RESPONSE_LEN),
            advantages=torch.randn(RESPONSE_LEN, generator=g), returns=torch.randn(RESPONSE_LEN, generator=g),
            reward=0.0, policy_version=0, uid=f"synthetic-{seed}-{i}"))
    return ExperienceBatch.merge(items, pad_token_id=0)


def print_table(rows: list[dict]) -> None:
    header = f"{'strategy':<24}{'step s':>9}{'peak GiB':>10}{'gather s':>10}{'push s':>9}{'push MB':>9}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            print(f"{row['strategy']:<24}{'-':>9}{'-':>10}{'-':>10}{'-':>9}{'-':>9}  FAILED: {row['error']}")
            continue
        print(f"{row['strategy']:<24}{row['step_s']:>9.3f}{row['peak_gib']:>10.2f}{row['gather_s']:>10.3f}"
              f"{row['push_s']:>9.3f}{row['push_mb']:>9.1f}  grad norm {row['actor_grad_norm']:.3g}")


if __name__ == "__main__":
    sys.exit(main())

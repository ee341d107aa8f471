"""The four advantage estimators on the sum_mod10 task, and what dropping the critic saves.

    python benchmarks/estimators.py [--steps 40] [--seeds 0,1,2] [--parallel 2] [--memory-model mid]

1. Learning: ``ray-ppo local`` (the synchronous loop: no staleness, so only the estimator differs)
   on ``configs/sum_mod10.yaml`` for gae, grpo, rloo and reinforce_pp, each with the same budget:
   ``--steps`` steps of 32 samples (gae and reinforce_pp: 32 prompts x 1 response; grpo and rloo:
   8 prompts x 4 responses), 3 seeds each, one process per run, ``--parallel`` at a time.
   Prints reward (mean of the last 10 steps) and wall-clock per estimator as mean +- std over seeds,
   and writes ``benchmarks/estimators.png``: reward against samples and against wall-clock seconds,
   mean +- std over seeds (each run's curve smoothed over 5 steps).
2. Memory: peak RSS (``ru_maxrss``) of a maker process (``MakerWorker`` without Ray: actor, reference
   and, for gae, the critic; 2 generation batches of 16 prompts) and of a trainer process
   (``PPOLearner`` with AdamW, 2 train steps on 32 items) with a critic (gae) and without (grpo),
   each in a fresh subprocess, on a GPT-2-shaped model with random weights (``--memory-model``:
   mid = 6 layers x 512, vocab 50257, ~45 M parameters; small = GPT-2 small, 124 M). The tiny
   model is too small for the critic to show in RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common
from _common import publish, rss_mb
from ray_ppo.config.choices import ADVANTAGES

ESTIMATORS = ADVANTAGES
GROUP = {"gae": 1, "grpo": 4, "rloo": 4, "reinforce_pp": 1}
"""maker.samples_per_prompt per estimator: the group estimators need groups, the others do not."""
MODEL_SHAPES = {"mid": (6, 512, 8), "small": (12, 768, 12)}
WINDOW = 10


def run_overrides(estimator: str, seed: int, steps: int, out: str) -> list[str]:
    n = GROUP[estimator]
    return [f"algo.advantage={estimator}", f"maker.samples_per_prompt={n}", f"maker.batch_size={32 // n}",
            "trainer.train_batch_size=32", "trainer.mini_batch_size=32", f"trainer.total_steps={steps}",
            f"seed={seed}", f"logging.output_dir={out}", "logging.tensorboard=false", "logging.progress=false",
            f"data.path={_common.ROOT / 'data' / 'sum_mod10_prompts.csv'}"]


def learning_run(estimator: str, seed: int, steps: int, root: Path) -> list[dict]:
    out = root / f"{estimator}-{seed}"
    cmd = [sys.executable, "-m", "ray_ppo.cli", "local", "--config", str(_common.ROOT / "configs" / "sum_mod10.yaml"),
           *run_overrides(estimator, seed, steps, str(out))]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(_common.ROOT)})
    if done.returncode:
        raise SystemExit(f"{estimator} seed {seed} failed:\n{done.stderr[-3000:]}")
    print(".", end="", file=sys.stderr, flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def mean_std(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def plot(runs: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for estimator, seeds in runs.items():
        curves = np.array([smooth([m["reward_mean"] for m in h]) for h in seeds])
        mean, std = curves.mean(0), curves.std(0)
        samples = np.arange(1, curves.shape[1] + 1) * 32
        wall = np.array([[m["elapsed_s"] for m in h] for h in seeds]).mean(0)
        for ax, x in ((ax_s, samples), (ax_t, wall)):
            ax.plot(x, mean, label=estimator)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax_s.set_xlabel("samples trained on")
    ax_t.set_xlabel("wall-clock s (mean over seeds)")
    for ax in (ax_s, ax_t):
        ax.set_ylabel("reward (5-step mean)")
        ax.grid(alpha=0.3)
    ax_s.legend()
    fig.suptitle(f"sum_mod10, tiny model, synchronous loop: mean ± std over {len(next(iter(runs.values())))} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def learning(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_estimators_"))
    jobs = [(e, s) for s in args.seeds for e in args.estimators]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: learning_run(*job, args.steps, root), jobs))
    print(file=sys.stderr)
    runs: dict[str, list[list[dict]]] = {}
    for (estimator, _), history in zip(jobs, results):
        runs.setdefault(estimator, []).append(history)
    rows = []
    for estimator, seeds in runs.items():
        first = [statistics.fmean(m["reward_mean"] for m in h[:WINDOW]) for h in seeds]
        last = [statistics.fmean(m["reward_mean"] for m in h[-WINDOW:]) for h in seeds]
        wall = [h[-1]["elapsed_s"] for h in seeds]
        step_s = [statistics.median(m["generate_s"] + m["train_s"] for m in h) for h in seeds]
        rows.append([estimator, GROUP[estimator], mean_std(first), mean_std(last), mean_std(wall), mean_std(step_s)])
    plot(runs, Path(__file__).with_name("estimators.png"))
    print(f"Estimators on sum_mod10: {args.steps} steps x 32 samples, seeds {args.seeds}, {args.parallel} runs at a time\n")
    publish("estimators", ["estimator", "samples/prompt", f"reward, first {WINDOW} steps", f"reward, last {WINDOW} steps",
                 "wall-clock s", "median step s"], rows, args=args)


def memory_child(role: str, estimator: str, pretrained: str) -> dict:
    import torch

    from ray_ppo.api import resolve_config
    from ray_ppo.config import load_config

    base = rss_mb()
    cfg = resolve_config(load_config(str(_common.ROOT / "configs" / "sum_mod10.yaml")).with_overrides({
        "model.pretrained": pretrained, "algo.advantage": estimator, "maker.samples_per_prompt": GROUP[estimator],
        "data.path": str(_common.ROOT / "data" / "sum_mod10_prompts.csv")}))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    texts = [f"{i % 10} {(i * 3) % 10}" for i in range(16 // GROUP[estimator])]
    if role == "maker":
        from ray_ppo.makers.worker import MakerWorker
        worker = MakerWorker(0, cfg.to_dict(), None)
        for _ in range(2):
            worker.maker.make_experience(worker.encoder.encode(texts).ids, 0)
        models = [worker.maker.actor, worker.maker.ref, worker.maker.critic]
    else:
        from ray_ppo.algo import ExperienceBatch, ExperienceItem
        from ray_ppo.models.build import build_actor, build_critic_if_needed
        from ray_ppo.train.learner import PPOLearner
        from ray_ppo.train.strategies import LocalStrategy
        learner = PPOLearner(build_actor(cfg), build_critic_if_needed(cfg), LocalStrategy(), cfg)
        R = 4
        items = [ExperienceItem(prompt_ids=torch.randint(3, 13, (3,)), response_ids=torch.randint(3, 13, (R,)),
                                action_log_probs=-torch.rand(R) * 3, ref_log_probs=-torch.rand(R) * 3,
                                values=torch.randn(R), rewards=torch.randn(R), advantages=torch.randn(R),
                                returns=torch.randn(R), reward=0.0, policy_version=0, uid=str(i)) for i in range(32)]
        for _ in range(2):  # AdamW states exist after the first step
            learner.train_step(ExperienceBatch.merge(items, 0), version=0)
        models = [learner.actor, learner.critic]
    params = sum(p.numel() for m in models if m is not None for p in m.parameters())
    return {"imports_mb": base, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params_m": params / 1e6, "models": sum(m is not None for m in models)}


def memory(args) -> None:
    from memory import build_gpt2_small

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n_layer, n_embd, n_head = MODEL_SHAPES[args.memory_model]
        pretrained = build_gpt2_small(os.path.join(tmp, "model"), n_layer, n_embd, n_head)
        for role in ("maker", "trainer"):
            for estimator in ("gae", "grpo"):
                out = subprocess.run([sys.executable, __file__, "--memory-child", role, estimator, pretrained],
                                     capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(_common.ROOT)})
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"memory {role} {estimator} failed:\n{out.stderr[-3000:]}")
                r = json.loads(line[0][7:])
                rows.append([role, estimator, "yes" if estimator == "gae" else "no", r["models"], r["params_m"],
                             r["peak_mb"], r["peak_mb"] - r["imports_mb"]])
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"\nMemory with and without a critic: {args.memory_model} GPT-2 shape "
          f"({n_layer} layers x {n_embd}, vocab 50257), CPU, float32, peak RSS of one process\n")
    publish("estimators_memory", ["process", "algo.advantage", "critic", "models held", "parameters held (M)", "peak RSS MiB",
                 "peak - imports MiB"], rows, args=args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--estimators", default=",".join(ESTIMATORS))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--memory-model", choices=sorted(MODEL_SHAPES), default="mid")
    ap.add_argument("--skip", choices=("learning", "memory"), help="run only the other part")
    ap.add_argument("--memory-child", nargs=3, metavar=("ROLE", "ESTIMATOR", "PRETRAINED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        print("RESULT " + json.dumps(memory_child(*args.memory_child)))
        return
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.estimators = args.estimators.split(",")
    start = time.perf_counter()
    if args.skip != "learning":
        learning(args)
    if args.skip != "memory":
        memory(args)
    print(f"\n({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()

"""The ``ray-ppo`` command line.

    ray-ppo train --config configs/tiny.yaml [--output DIR] [--address ADDR] [key=value ...]
    ray-ppo local --config configs/tiny.yaml [--output DIR] [key=value ...]
    ray-ppo toy-data DIR

Bad input (unknown key, bad value, missing file) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from ray_ppo.config import ConfigError, load_config
from ray_ppo.data import DataError

EXIT_USAGE = 2


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (configs/tiny.yaml is the CPU demo)")
    parser.add_argument("--output", "-o", help="run directory (default: logging.output_dir, else runs/<name>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. ppo.kl_coef=0.05 trainer.total_steps=20")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-ppo", description="Detached PPO for language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="detached PPO on a Ray cluster (makers + coordinator + TorchTrainer)",
                           description="Run detached PPO: makers generate while a TorchTrainer trains. Writes "
                                       "DIR/config.yaml, DIR/metrics.jsonl and DIR/checkpoint/.")
    _config_args(train)
    train.add_argument("--address", help="attach to a running Ray cluster (e.g. auto or ray://host:10001) "
                                         "instead of starting a local one")
    train.add_argument("--num-cpus", type=int, default=None,
                       help="logical CPUs of the local Ray cluster (default: max(8, cores)); ignored with --address")
    local = sub.add_parser("local", help="the synchronous single-process PPO loop (no Ray)",
                           description="Generate, then train, in one process: the baseline of the benchmarks.")
    _config_args(local)
    toy = sub.add_parser("toy-data", help="write the toy task's prompt files (CSV and Parquet)")
    toy.add_argument("directory")
    toy.add_argument("--num-prompts", type=int, default=512)
    toy.add_argument("--prompt-len", type=int, default=6)
    toy.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"train": cmd_train, "local": cmd_local, "toy-data": cmd_toy_data}[args.command](args)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"ray-ppo {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"ray-ppo {args.command}: interrupted", file=sys.stderr)
        return 130


def _load(args):
    cfg = load_config(args.config, args.overrides)
    if args.output:
        cfg = cfg.with_overrides({"logging.output_dir": args.output})
    return cfg


def _summary(history: list[dict], wall_s: float, out_dir: Path) -> str:
    if not history:
        return f"no steps completed in {wall_s:.0f} s"
    n = max(1, len(history) // 10)
    first = sum(m["reward_mean"] for m in history[:n]) / n
    last = sum(m["reward_mean"] for m in history[-n:]) / n
    samples_per_s = sum(m["samples_per_s"] for m in history) / len(history)
    return (f"done: {len(history)} steps in {wall_s:.0f} s | reward {first:.3f} (first 10%) -> {last:.3f} (last 10%) "
            f"| {samples_per_s:.1f} samples/s | run dir {out_dir}")


def cmd_train(args) -> int:
    import ray

    from ray_ppo.api import PPOTrainer
    from ray_ppo.tracking import LiveLine, RunDirectory

    cfg = _load(args)
    out_dir = Path(cfg.output_dir).resolve()
    run_dir = RunDirectory(out_dir, cfg)
    if args.address:
        ray.init(address=args.address, log_to_driver=True)
    else:
        # Ray Train's controller polls workers every 2 s by default and each ray.train.report
        # waits for that poll; a faster poll keeps reports cheap on a local cluster.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        # Worker logs stay in the Ray session directory; errors reach the driver as exceptions.
        ray.init(num_cpus=args.num_cpus or max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    trainer = PPOTrainer(cfg, metrics_callbacks=[run_dir, LiveLine(cfg.trainer.total_steps)])
    try:
        result = trainer.fit()
    finally:
        run_dir.close()
        ray.shutdown()
    if result.checkpoint is not None:
        target = out_dir / "checkpoint"
        shutil.rmtree(target, ignore_errors=True)
        result.checkpoint.to_directory(str(target))
    print(_summary(trainer.history, time.perf_counter() - start, out_dir))
    return 0


def cmd_local(args) -> int:
    from ray_ppo.local import run_local
    from ray_ppo.tracking import LiveLine, RunDirectory

    cfg = _load(args)
    out_dir = Path(cfg.output_dir).resolve()
    run_dir = RunDirectory(out_dir, cfg)
    live = LiveLine(cfg.trainer.total_steps)
    start = time.perf_counter()
    try:
        history = run_local(cfg, on_metrics=lambda m: (run_dir(m), live(m)))
    finally:
        run_dir.close()
    print(_summary(history, time.perf_counter() - start, out_dir))
    return 0


def cmd_toy_data(args) -> int:
    from ray_ppo.tasks.toy import write_prompt_files

    for path in write_prompt_files(args.directory, args.num_prompts, args.prompt_len, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

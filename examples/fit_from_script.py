"""Detached PPO from a script: TorchTrainer.fit() with Ray Data prompts read from CSV.

    python examples/fit_from_script.py [--steps 30] [--prompts data/toy_prompts.csv] [KEY=VALUE ...]
"""

import argparse
import logging
from pathlib import Path

import ray

from ray_ppo import PPOTrainer, load_config
from ray_ppo.config import Config

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", default=str(REPO / "data" / "toy_prompts.csv"))
    parser.add_argument("--output", default="runs/fit_from_script")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as `ray-ppo train` takes them (e.g. maker.num_makers=1)")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace) -> Config:
    """The tiny demo's config with the steps, run directory and overrides of the command line."""
    return load_config(REPO / "configs" / "tiny.yaml",
                       [f"trainer.total_steps={args.steps}", f"logging.output_dir={args.output}", *args.overrides])


def main() -> None:
    args = parse_args()
    cfg = run_config(args)  # first: a bad override fails here, in one line, before any Ray process starts
    # A new local cluster, never an existing one; the workers' logs stay in its session directory
    # (errors still reach this script as exceptions).
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # Ray Data logs each read's plan and progress
    prompts = ray.data.read_csv(args.prompts)  # any Ray Data source works: read_parquet, read_json, ...
    trainer = PPOTrainer(cfg, prompts=prompts)  # a ray.train.torch.TorchTrainer
    result = trainer.fit()                      # a ray.train.Result
    first, last = trainer.history[0]["reward_mean"], trainer.history[-1]["reward_mean"]
    print(f"steps={result.metrics['step']} reward {first:.3f} -> {last:.3f} checkpoint={result.checkpoint.path}")
    ray.shutdown()


if __name__ == "__main__":
    main()

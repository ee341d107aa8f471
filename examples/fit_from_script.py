"""Detached PPO from a script: TorchTrainer.fit() with Ray Data prompts read from CSV.

    python examples/fit_from_script.py [--steps 30] [--prompts data/toy_prompts.csv] [KEY=VALUE ...]
"""

import argparse
from pathlib import Path

import ray

from ray_ppo import PPOTrainer, load_config

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", default=str(REPO / "data" / "toy_prompts.csv"))
    parser.add_argument("--output", default="runs/fit_from_script")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as `ray-ppo train` takes them (e.g. maker.num_makers=1)")
    args = parser.parse_args()

    # A new local cluster, never an existing one. Its dashboard (on loopback) serves the state API
    # that Ray Train's placement-group cleaner polls: without it, the cleaner warns every second.
    ray.init(address="local", num_cpus=8, include_dashboard=True, dashboard_host="127.0.0.1")
    prompts = ray.data.read_csv(args.prompts)  # any Ray Data source works: read_parquet, read_json, ...
    cfg = load_config(REPO / "configs" / "tiny.yaml",
                      [f"trainer.total_steps={args.steps}", f"logging.output_dir={args.output}", *args.overrides])
    trainer = PPOTrainer(cfg, prompts=prompts)  # a ray.train.torch.TorchTrainer
    result = trainer.fit()                      # a ray.train.Result
    first, last = trainer.history[0]["reward_mean"], trainer.history[-1]["reward_mean"]
    print(f"steps={result.metrics['step']} reward {first:.3f} -> {last:.3f} checkpoint={result.checkpoint.path}")
    ray.shutdown()


if __name__ == "__main__":
    main()

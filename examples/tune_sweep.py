"""A Ray Tune sweep over kl_coef x eps_clip, each trial a detached PPO run.

    python examples/tune_sweep.py [--steps 20] [KEY=VALUE ...]
"""

import argparse
from pathlib import Path

import ray
from ray import tune

from ray_ppo import load_config
from ray_ppo.cluster.sweep import sweep

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="runs/tune_sweep")
    parser.add_argument("--max-concurrent", type=int, default=2)
    parser.add_argument("--kl-coefs", default="0.001,0.1", help="comma-separated ppo.kl_coef values")
    parser.add_argument("--eps-clips", default="0.1,0.2", help="comma-separated ppo.eps_clip values")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as `ray-ppo train` takes them (e.g. maker.num_makers=1)")
    args = parser.parse_args()

    base = load_config(REPO / "configs" / "tiny.yaml", [f"trainer.total_steps={args.steps}", *args.overrides])
    space = {"ppo.kl_coef": tune.grid_search([float(v) for v in args.kl_coefs.split(",")]),
             "ppo.eps_clip": tune.grid_search([float(v) for v in args.eps_clips.split(",")])}
    # No cluster is connected, so sweep() starts a local one, as `ray-ppo tune` does: with the
    # dashboard (on loopback), whose state API lets Ray Train free the CPUs of a trial that a
    # scheduler stops early (docs/tune.md).
    outcome = sweep(base, space,
                    metric="reward_mean", mode="max", max_concurrent_trials=args.max_concurrent,
                    output_dir=args.output)
    # sweep() printed a line per trial as it ended; outcome.trials has them all (trials.csv too).
    print(f"best {outcome.best_config} reward_mean={outcome.best_metric:.3f} checkpoint={outcome.best_checkpoint}")
    ray.shutdown()


if __name__ == "__main__":
    main()

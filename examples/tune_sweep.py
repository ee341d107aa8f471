"""A Ray Tune sweep over kl_coef x eps_clip, each trial a detached PPO run.

    python examples/tune_sweep.py [--steps 20]
"""

import argparse
from pathlib import Path

import ray
from ray import tune

from ray_ppo import load_config
from ray_ppo.sweep import sweep

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="runs/tune_sweep")
    parser.add_argument("--max-concurrent", type=int, default=2)
    args = parser.parse_args()

    ray.init(num_cpus=8, include_dashboard=False)
    base = load_config(REPO / "configs" / "tiny.yaml", [f"trainer.total_steps={args.steps}"])
    outcome = sweep(base, {"ppo.kl_coef": tune.grid_search([0.001, 0.1]), "ppo.eps_clip": tune.grid_search([0.1, 0.2])},
                    metric="reward_mean", mode="max", max_concurrent_trials=args.max_concurrent,
                    output_dir=args.output)
    for trial in outcome.trials:
        print(f"trial {trial['trial_id']} kl_coef={trial['ppo.kl_coef']} eps_clip={trial['ppo.eps_clip']} "
              f"reward_mean={trial['reward_mean']} {trial['status']}")
    print(f"best {outcome.best_config} reward_mean={outcome.best_metric:.3f} checkpoint={outcome.best_checkpoint}")
    ray.shutdown()


if __name__ == "__main__":
    main()

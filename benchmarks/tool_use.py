"""SmolLM2-135M-Instruct learning to use a calculator: the training curve over seeds, and held-out
accuracy with the tool and without it, before and after training.

    make bench-tool-use     # = ray-ppo train --config configs/smollm2_calculator.yaml, then this script
    python benchmarks/tool_use.py --runs runs/smollm2_calculator [runs/smollm2_calculator_s1 ...]
    python benchmarks/tool_use.py --agent --runs runs/smollm2_calculator_agent [...]   # agent.fn runs

``--agent``: the runs trained ``configs/smollm2_calculator_agent.yaml`` (the same task written as
agent code, ``ray_ppo.tasks.calculator_agent``, against the makers' endpoint); their held-out
accuracy with the tool is the agent's, run by the evaluation through the endpoint; the table goes
to ``tool_use_agent``.

The curve is each run's own ``metrics.jsonl``: the episodes' mean reward (the share answered
right, sampled at temperature 1, with the tool) at step 1 and at the last step within 5, 10 and 15
minutes of the training loop's start, and the calculator calls per episode (``env/tool_calls``).
The train questions of a step are new ones (8 a step of 2048), so the sampled reward is already
an accuracy on questions the policy has not trained on. Held-out accuracy is
``ray_ppo.makers.evaluation.evaluate``, greedy, on the first ``--num-prompts`` questions of
``calculator_eval.jsonl`` answered in episodes with the tool (``CalculatorEnv``, up to 3 turns)
and of ``calculator_eval_no_tool.jsonl`` (the same questions asked plainly, one turn,
``env.cls=null``), for the base model and each run's last checkpoint; the eval questions are in
no run's training set (``ray_ppo.tasks.calculator.make_problems``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import ROOT, publish

CONFIG = ROOT / "configs" / "smollm2_calculator.yaml"
AGENT_CONFIG = ROOT / "configs" / "smollm2_calculator_agent.yaml"
MINUTES = (5, 10, 15)


def held_out(model: str, num_prompts: int, agent: bool = False) -> tuple[float, float]:
    """Greedy held-out accuracy of ``model`` (a name or run directory) with the tool (the
    environment's episodes, or with ``agent`` the agent's) and without."""
    from ray_ppo.config import load_config
    from ray_ppo.makers.evaluation import evaluate

    cfg = load_config(str(AGENT_CONFIG if agent else CONFIG))
    with_tool = evaluate(cfg, model, str(ROOT / "data" / "calculator_eval.jsonl"), num_prompts)
    without = evaluate(cfg.with_overrides({"env.cls": None, "agent.fn": None, "maker.max_running": 0}), model,
                       str(ROOT / "data" / "calculator_eval_no_tool.jsonl"), num_prompts)
    return with_tool.accuracy, without.accuracy


def curve(run: Path) -> list:
    """The columns of a run's row before its held-out accuracy (see ``HEADERS``)."""
    import yaml

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seed = yaml.safe_load((run / "config.yaml").read_text())["seed"]

    def by(seconds: float):
        within = [r for r in rows if r["elapsed_s"] <= seconds]
        return within[-1]["reward_mean"] if within else ""

    first, last = rows[0], rows[-1]
    calls = f"{first.get('env/tool_calls', 0.0):.2f} -> {last.get('env/tool_calls', 0.0):.2f}"
    return [f"seed {seed}", first["reward_mean"], *(by(60 * m) for m in MINUTES), last["reward_mean"],
            f"{last['step']} ({last['elapsed_s']:.0f} s)", calls]


HEADERS = ["run", "reward step 1", "<= 5 min", "<= 10 min", "<= 15 min", "last", "last step (time)",
           "tool calls / episode, step 1 -> last", "held-out with the tool", "held-out without"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", nargs="+", default=[str(ROOT / "runs" / "smollm2_calculator")])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--agent", action="store_true", help="the runs trained the agent (smollm2_calculator_agent.yaml)")
    args = p.parse_args()
    rows = [["base model", *[""] * 7, *held_out("smollm2-135m-instruct", args.num_prompts, args.agent)]]
    print(rows[-1], flush=True)
    for run in map(Path, args.runs):
        rows.append([*curve(run), *held_out(str(run), args.num_prompts, args.agent)])
        print(rows[-1], flush=True)
    episodes = "written by agent code against the makers' endpoint" if args.agent else "with CalculatorEnv"
    publish("tool_use_agent" if args.agent else "tool_use", HEADERS, rows, args,
            title=f"SmolLM2-135M-Instruct, calculator task, multi-turn GRPO, episodes {episodes}: reward = share "
                  f"right, sampled, with the tool; held-out = greedy, {args.num_prompts} questions")


if __name__ == "__main__":
    main()

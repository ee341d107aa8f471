"""A multi-turn task with a tool: multiplications too hard for a small model's head, and a calculator.

    make_problems("train", num=512)      # Problem(347, "times", 29): "What is 347 times 29? ..."
    CalculatorEnv                        # env.cls=ray_ppo.tasks.calculator:CalculatorEnv

The prompt says how to call the calculator (``ray_ppo.tools``) and shows one worked example; each
turn the policy either calls it (the environment answers with the result as a ``tool`` message) or
answers, which ends the episode with reward 1.0 when the answer is right
(``ray_ppo.tasks.arithmetic.reward``). The same questions asked plainly and scored by that reward in
one turn (``calculator_eval_no_tool.jsonl``) are the task without the tool. Questions: a
three-digit number times a two-digit one; train and eval splits by the hash rule of the arithmetic
task (``split_of``), so they never share a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ray_ppo.env import Environment, Turn
from ray_ppo.tasks.arithmetic import INSTRUCTION, Problem, reward, split_of
from ray_ppo.tools import CALCULATOR, calculate, parse_tool_calls

SYSTEM = ('You can use a calculator. To use it, write <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "..."}}</tool_call> and you will be told the result. Then give the answer as a number.')
EXAMPLE = Problem(123, "times", 45)


def call(expression: str) -> str:
    """A calculator call as the policy writes it (``ray_ppo.tools.parse_tool_calls`` reads it)."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def messages(problem: Problem) -> list[dict]:
    """The chat prompt: how to call the calculator (system), one worked example (a question, the
    call, the result, the answer), then the question and ``INSTRUCTION``. A small model answers
    without the example and never calls the tool (SmolLM2-135M-Instruct: 0 calls in 32 samples)."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{EXAMPLE.question} {INSTRUCTION}"},
            {"role": "assistant", "content": call(f"{EXAMPLE.a} * {EXAMPLE.b}")},
            {"role": "tool", "content": str(EXAMPLE.answer)},
            {"role": "assistant", "content": f"The answer is {EXAMPLE.answer}."},
            {"role": "user", "content": f"{problem.question} {INSTRUCTION}"}]


def make_problems(split: str, num: int, seed: int = 0) -> list[Problem]:
    """``num`` distinct questions of ``split`` ("train" or "eval"), deterministic for a seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; choose 'train' or 'eval'")
    rng, out = random.Random(f"{seed}:{split}:calculator"), {}
    while len(out) < num:
        problem = Problem(rng.randrange(100, 1000), "times", rng.randrange(10, 100))
        if split_of(problem) == split and problem != EXAMPLE:  # the prompt's example is in no split
            out.setdefault(problem, None)
    return list(out)


def write_problem_files(directory: str | Path, num_train: int = 2048, num_eval: int = 200,
                        seed: int = 0) -> tuple[Path, Path, Path]:
    """Write ``calculator_train.jsonl`` and ``calculator_eval.jsonl`` (``prompt``: the chat with the
    tool; ``answer``), and ``calculator_eval_no_tool.jsonl``: the same held-out questions asked as
    the arithmetic task asks them, for the model without the tool."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for stem, split, num, render in (("calculator_train", "train", num_train, messages),
                                     ("calculator_eval", "eval", num_eval, messages),
                                     ("calculator_eval_no_tool", "eval", num_eval, Problem.messages)):
        path = directory / f"{stem}.jsonl"
        rows = [{"prompt": render(p), "answer": str(p.answer)} for p in make_problems(split, num, seed)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        files.append(path)
    return files[0], files[1], files[2]


class CalculatorEnv(Environment):
    """Answers tool calls with the calculator's results; scores the first answer without a call."""

    tools = [CALCULATOR]

    def step(self, response: str) -> Turn:
        calls = parse_tool_calls(response)
        if not calls:
            return Turn(reward=reward([self.prompt], [response])[0], done=True)
        results = [calculate(str(c["arguments"].get("expression", ""))) if c["name"] == "calculator"
                   else f"error: {c.get('error') or 'there is no tool named ' + repr(c['name'])}" for c in calls]
        return Turn(observation=[{"role": "tool", "content": r} for r in results], info={"tool_calls": len(calls)})

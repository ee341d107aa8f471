"""Arithmetic answers of very uneven length, for benchmarking streaming makers (continuous batching,
``maker.schedule``): short questions answered in a few tokens, mixed with questions worked in steps.

    problems = make_problems("train", num=512, seed=0, long_share=0.5)
    problems[0].messages()           # the chat prompt: [{"role": "user", ...}]
    reward(prompts, responses)       # 1.0 where the response's answer is right, either variant
    write_problem_files("data")      # long_tail_train.jsonl, long_tail_eval.jsonl

- **Short** (``1 - long_share`` of the questions): the arithmetic task's questions of ``short_level``
  as it asks them (``ray_ppo.tasks.arithmetic.Problem``: "What is 47 plus 38? Answer with a
  number."). Level 2 unless given; ``configs/smollm2_long_tail.yaml`` trains on level 1, which
  SmolLM2 answers right often enough at temperature 1 to learn from (at level 2 it sampled no
  right answer in 64 tries).
- **Worked** (``long_share``): a sum of 3 to 6 two-digit numbers or a product of two two-digit
  numbers, asking for every step and a closing ``Answer: N`` (``Worked``: "What is 23 plus 45 plus
  67? Show every step, ..."). A right answer in steps (``Worked.solution``) is 39 to 100 tokens.
- **Lengths** (SmolLM2-135M-Instruct, 16 eval questions of each variant, at most 256 new tokens):
  short answers 10 to 63 tokens greedily (median 14); worked ones 13 to 256 greedily (median 32, 3
  at the cap) and 14 to 256 at temperature 1 (median 82, 2 at the cap).
- **Splits, answers, reward**: the arithmetic task's: a question's split is the hash rule of
  ``split_of`` on its text, so train and eval never share one; the answer is the number after the
  last ``Answer:``, else the last number (``extract_answer``); the reward reads the question back
  from the prompt, so a prompt file needs no answer column.

Use: ``write_problem_files(DIR)``, then train or benchmark with
``data.path=DIR/long_tail_train.jsonl model.reward_fn=ray_ppo.tasks.long_tail:reward``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Sequence

from ray_ppo.data import Prompt
from ray_ppo.tasks import arithmetic
from ray_ppo.tasks.arithmetic import OPS, Problem, split_of

SHORT_LEVEL = 2
"""The arithmetic level of the short questions: two-digit sums and differences."""
SUM_TERMS = (3, 6)
"""The fewest and most numbers of a worked sum."""
STEPS = "Show every step, then give the result as 'Answer: ' followed by the number."
CHAIN = re.compile(r"What is (-?\d+ (plus|minus|times) -?\d+(?: \2 -?\d+)*)\?")
"""A question of either variant: numbers joined by one operation."""


@dataclass(frozen=True)
class Worked:
    """A question to work in steps: ``terms`` joined by ``op`` ("plus" or "times"), left to right."""

    terms: tuple[int, ...]
    op: str

    @property
    def question(self) -> str:
        return "What is " + f" {self.op} ".join(map(str, self.terms)) + "?"

    @property
    def answer(self) -> int:
        return reduce(OPS[self.op], self.terms)

    def messages(self) -> list[dict]:
        """The chat prompt: one user message, the question and ``STEPS``."""
        return [{"role": "user", "content": f"{self.question} {STEPS}"}]

    def solution(self) -> str:
        """A right answer in steps, ending in ``Answer: N``: one line a partial sum, or a product by
        the tens and the units of the second number."""
        if self.op == "times" and len(self.terms) == 2:
            a, b = self.terms
            tens, units = b - b % 10, b % 10
            lines = [f"{a} x {b} = {a} x {tens} + {a} x {units}.", f"{a} x {tens} = {a * tens}.",
                     f"{a} x {units} = {a * units}.", f"{a * tens} + {a * units} = {self.answer}."]
        else:
            totals = [reduce(OPS[self.op], self.terms[:i + 1]) for i in range(len(self.terms))]
            sign = {"plus": "+", "minus": "-", "times": "x"}[self.op]
            lines = [f"{totals[i - 1]} {sign} {self.terms[i]} = {totals[i]}." for i in range(1, len(self.terms))]
        return "\n".join(f"Step {i}: {line}" for i, line in enumerate(lines, 1)) + f"\nAnswer: {self.answer}"


def worked_problems(split: str, num: int, seed: int = 0) -> list[Worked]:
    """``num`` distinct worked questions of ``split``, half sums and half products (by chance), deterministic for a seed."""
    rng, out = random.Random(f"{seed}:{split}:worked"), {}
    while len(out) < num:
        if rng.random() < 0.5:
            problem = Worked(tuple(rng.randrange(10, 100) for _ in range(rng.randint(*SUM_TERMS))), "plus")
        else:
            problem = Worked((rng.randrange(10, 100), rng.randrange(10, 100)), "times")
        if split_of(problem) == split:  # split_of reads the question's text alone
            out.setdefault(problem, None)
    return list(out)


def make_problems(split: str, num: int, seed: int = 0, long_share: float = 0.5,
                  short_level: int = SHORT_LEVEL) -> list[Problem | Worked]:
    """``num`` questions of ``split`` ("train" or "eval"), ``round(num * long_share)`` of them worked,
    the rest short questions of the arithmetic task's ``short_level``, shuffled together;
    deterministic for a seed."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share={long_share!r}; choose a share in [0, 1]")
    worked = round(num * long_share)
    problems = arithmetic.make_problems(split, short_level, num - worked, seed) + worked_problems(split, worked, seed)
    random.Random(f"{seed}:{split}:long_tail").shuffle(problems)
    return problems


def parse_problem(prompt: Prompt) -> Problem | Worked | None:
    """The question in a prompt (a text, or a chat whose last user message holds it): ``Worked`` when
    it asks for the steps or joins more than two numbers, else ``Problem``; None if it holds none."""
    text = prompt if isinstance(prompt, str) else next(
        (m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    match = CHAIN.search(text)
    if match is None:
        return None
    terms = tuple(int(n) for n in match[1].split(f" {match[2]} "))
    if len(terms) > 2 or STEPS in text[match.end():]:
        return Worked(terms, match[2])
    return Problem(terms[0], match[2], terms[1])


def reward(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """Rule reward (the ``model.reward_fn`` signature): 1.0 where the response's answer equals the
    question's, else 0.0 (also for a prompt that holds no question)."""
    return arithmetic.score(prompts, responses, parse_problem)


def write_problem_files(directory: str | Path, num_train: int = 2048, num_eval: int = 200, seed: int = 0,
                        long_share: float = 0.5, short_level: int = SHORT_LEVEL) -> tuple[Path, Path]:
    """Write ``long_tail_train.jsonl`` and ``long_tail_eval.jsonl`` to ``directory``, as the arithmetic
    task writes its files: one row a question, with ``prompt`` (the chat messages) and ``answer``."""
    return arithmetic.write_splits(directory, "long_tail", make_problems("train", num_train, seed, long_share, short_level),
                                   make_problems("eval", num_eval, seed, long_share, short_level))

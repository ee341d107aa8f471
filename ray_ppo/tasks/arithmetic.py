"""Arithmetic questions for an instruct model: seeded, three levels, disjoint train and eval splits.

    problems = make_problems("train", level=2, num=512, seed=0)    # Problem(a, op, b): "What is 47 plus 38? ..."
    problems[0].messages()                                         # the chat prompt: [{"role": "user", ...}]
    reward(prompts, responses)                                     # 1.0 where the response's answer is right

The reward reads the question back from the prompt, so a prompt file needs no answer column
(``write_problem_files`` writes one anyway, for evaluation and for people). Copy this module for
a task of your own: a generator, a split rule, an answer extractor and a reward of this shape.

- **Levels**: 1, sums, differences and products of one-digit numbers (300 questions; SmolLM2-135M-Instruct
  answers ~half of them greedily, so RL has room and signal); 2, two-digit sums and differences
  (16,200); 3, a two-digit number times a one-digit number (720).
- **Splits**: a question is in ``eval`` when a hash of its text falls in ``EVAL_SHARE`` of the
  range, else in ``train``, whatever the seed: the splits never share a question.
- **Answer extraction**: the number after the last ``Answer:`` in the response, else the last
  number in it (``"7 + 5 = 12."`` answers 12; ``"12, since 5 + 7"`` answers 7).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ray_ppo.data import Prompt

LEVELS = (1, 2, 3)
EVAL_SHARE = 0.2
"""Share of each level's questions held out for evaluation."""
OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
INSTRUCTION = "Answer with a number."
QUESTION = re.compile(r"What is (-?\d+) (plus|minus|times) (-?\d+)\?")
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
ANSWER_TAG = re.compile(r"answer\s*(?:is)?\s*:?", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)

    def messages(self) -> list[dict]:
        """The chat prompt: one user message, the question and ``INSTRUCTION``."""
        return [{"role": "user", "content": f"{self.question} {INSTRUCTION}"}]


def level_problems(level: int) -> list[Problem]:
    """Every question of ``level``, in a fixed order."""
    if level == 1:
        return [Problem(a, op, b) for op in ("plus", "minus", "times") for a in range(10) for b in range(10)]
    if level == 2:
        return [Problem(a, op, b) for op in ("plus", "minus") for a in range(10, 100) for b in range(10, 100)]
    if level == 3:
        return [Problem(a, "times", b) for a in range(10, 100) for b in range(2, 10)]
    raise ValueError(f"level={level!r} is not a level of the arithmetic task; choose one of {list(LEVELS)}")


def split_of(problem: Problem) -> str:
    """``"eval"`` or ``"train"``, from a hash of the question alone (so no seed moves a question)."""
    digest = int.from_bytes(hashlib.sha256(problem.question.encode()).digest()[:8], "big")
    return "eval" if digest < EVAL_SHARE * 2**64 else "train"


def make_problems(split: str, level: int, num: int, seed: int = 0) -> list[Problem]:
    """``num`` questions of ``split`` ("train" or "eval") at ``level``, deterministic for a seed.
    Distinct while the split has enough questions; then each question appears as evenly as it can."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; choose 'train' or 'eval'")
    pool = [p for p in level_problems(level) if split_of(p) == split]
    rng = random.Random(f"{seed}:{split}:{level}")
    out: list[Problem] = []
    while len(out) < num:
        out += rng.sample(pool, min(len(pool), num - len(out)))
    return out


def parse_problem(prompt: Prompt) -> Problem | None:
    """The question in a prompt (a text, or a chat whose last user message holds it), or None."""
    text = prompt if isinstance(prompt, str) else next(
        (m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
    match = QUESTION.search(text)
    return Problem(int(match[1]), match[2], int(match[3])) if match else None


def extract_answer(response: str) -> int | None:
    """The number a response gives as its answer (see the module doc), or None."""
    tags = list(ANSWER_TAG.finditer(response))
    tail = response[tags[-1].end():] if tags else response
    numbers = NUMBER.findall(tail)
    if not numbers:
        return None
    number = numbers[0] if tags else numbers[-1]
    value = float(number.replace(",", ""))
    return int(value) if value.is_integer() else None


def reward(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """Rule reward (the ``model.reward_fn`` signature): 1.0 where the response's answer equals the
    question's, else 0.0 (also for a prompt that holds no question)."""
    return score(prompts, responses, parse_problem)


def score(prompts: Sequence[Prompt], responses: Sequence[str], parse: Callable[[Prompt], object | None]) -> list[float]:
    """1.0 where a response's answer (``extract_answer``) equals the ``answer`` of the problem that
    ``parse`` reads from its prompt, else 0.0 (also where ``parse`` finds none): the reward of a
    task of this shape."""
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        problem = parse(prompt)
        scores.append(float(problem is not None and extract_answer(response) == problem.answer))
    return scores


def write_problem_files(directory: str | Path, level: int = 2, num_train: int = 2048, num_eval: int = 200,
                        seed: int = 0) -> tuple[Path, Path]:
    """Write ``arithmetic_l{level}_train.jsonl`` and ``_eval.jsonl`` to ``directory``: one row a
    question, with ``prompt`` (the chat messages) and ``answer``."""
    return write_splits(directory, f"arithmetic_l{level}", make_problems("train", level, num_train, seed),
                        make_problems("eval", level, num_eval, seed))


def write_splits(directory: str | Path, stem: str, train: Sequence, evaluation: Sequence) -> tuple[Path, Path]:
    """Write ``{stem}_train.jsonl`` and ``{stem}_eval.jsonl`` to ``directory``: one row a problem
    (anything with ``messages()`` and ``answer``), with ``prompt`` (the chat messages) and ``answer``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, problems in (("train", train), ("eval", evaluation)):
        path = directory / f"{stem}_{split}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p.messages(), "answer": str(p.answer)}) + "\n" for p in problems))
        paths.append(path)
    return paths[0], paths[1]

"""The arithmetic task (``ray_ppo.tasks.arithmetic``): splits, prompts, answer extraction, reward."""

from __future__ import annotations

import json

import pytest

from ray_ppo.cli import main
from ray_ppo.data import read_prompt_texts
from ray_ppo.tasks.arithmetic import (
    LEVELS,
    Problem,
    extract_answer,
    level_problems,
    make_problems,
    parse_problem,
    reward,
    split_of,
)


@pytest.mark.parametrize("level", LEVELS)
def test_the_splits_never_share_a_question_and_hold_out_about_a_fifth(level):
    problems = level_problems(level)
    held_out = [p for p in problems if split_of(p) == "eval"]
    assert 0.12 < len(held_out) / len(problems) < 0.28
    train = {p.question for p in make_problems("train", level, 400, seed=3)}
    evals = {p.question for p in make_problems("eval", level, 400, seed=3)}
    assert train and evals and not train & evals


def test_questions_are_seeded_and_distinct_while_the_split_has_enough():
    assert make_problems("train", 2, 50, seed=1) == make_problems("train", 2, 50, seed=1)
    assert make_problems("train", 2, 50, seed=1) != make_problems("train", 2, 50, seed=2)
    assert len(set(make_problems("eval", 2, 500, seed=0))) == 500
    small = make_problems("eval", 1, 150, seed=0)  # level 1 holds ~60 eval questions: each repeats evenly
    counts = {p: small.count(p) for p in small}
    assert max(counts.values()) - min(counts.values()) <= 1


def test_the_levels_hold_the_questions_the_doc_says():
    assert [len(level_problems(level)) for level in LEVELS] == [300, 16200, 720]
    assert Problem(47, "minus", 58).answer == -11 and Problem(12, "times", 7).answer == 84
    with pytest.raises(ValueError, match="level=4 is not a level"):
        level_problems(4)


def test_a_prompt_is_a_chat_whose_question_reads_back():
    problem = Problem(47, "plus", 38)
    assert problem.messages() == [{"role": "user", "content": "What is 47 plus 38? Answer with a number."}]
    assert parse_problem(problem.messages()) == problem
    system = [{"role": "system", "content": "You are terse."}, *problem.messages()]
    assert parse_problem(system) == problem and parse_problem("What is 3 times 4?") == Problem(3, "times", 4)
    assert parse_problem("hello") is None


@pytest.mark.parametrize("response, answer", [
    ("85", 85),
    ("47 + 38 = 85.", 85),                        # the last number
    ("The answer is 85. Easy!", 85),              # after the last "answer"
    ("Answer: -11", -11),
    ("12, since 5 + 7", 7),                       # the last number, as documented
    ("Answer: 1,234 apples", 1234),
    ("about 8.5", None),                          # not a whole number
    ("I do not know", None),
])
def test_the_answer_a_response_gives(response, answer):
    assert extract_answer(response) == answer


def test_the_reward_is_one_for_the_right_answer_and_zero_otherwise():
    prompts = [Problem(7, "plus", 5).messages()] * 3 + ["not a question"]
    assert reward(prompts, ["7 + 5 = 12", "7 + 5 = 13", "", "12"]) == [1.0, 0.0, 0.0, 0.0]


def test_toy_data_writes_the_train_and_eval_files_the_trainer_reads(tmp_path, capsys):
    assert main(["toy-data", str(tmp_path), "--task", "arithmetic", "--level", "2", "--num-prompts", "64",
                 "--num-eval", "16"]) == 0
    train, evals = (tmp_path / "arithmetic_l2_train.jsonl", tmp_path / "arithmetic_l2_eval.jsonl")
    assert capsys.readouterr().out.split() == [str(train), str(evals)]
    prompts = read_prompt_texts(str(train), "prompt")  # chat messages, as a run reads them
    assert len(prompts) == 64 and prompts[0][0]["role"] == "user"
    rows = [json.loads(line) for line in evals.read_text().splitlines()]
    assert len(rows) == 16
    assert reward([r["prompt"] for r in rows], [r["answer"] for r in rows]) == [1.0] * 16

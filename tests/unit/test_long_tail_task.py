"""The long-tail task (``ray_ppo.tasks.long_tail``): the mix of short and worked questions, splits, reward, files."""

from __future__ import annotations

import json

import pytest

from ray_ppo.data import read_prompt_texts
from ray_ppo.tasks.arithmetic import Problem
from ray_ppo.tasks.long_tail import (
    STEPS,
    Worked,
    make_problems,
    parse_problem,
    reward,
    worked_problems,
    write_problem_files,
)


def test_questions_are_seeded():
    assert make_problems("train", 64, seed=1) == make_problems("train", 64, seed=1)
    assert make_problems("train", 64, seed=1) != make_problems("train", 64, seed=2)
    assert worked_problems("eval", 32, seed=0) == worked_problems("eval", 32, seed=0)


def test_the_splits_never_share_a_question():
    train = {p.question for p in make_problems("train", 600, seed=3)}
    evals = {p.question for p in make_problems("eval", 600, seed=3)}
    assert len(train) == len(evals) == 600 and not train & evals


@pytest.mark.parametrize("long_share, worked", [(0.0, 0), (0.25, 25), (0.5, 50), (1.0, 100)])
def test_long_share_of_the_questions_are_worked_and_the_rest_short(long_share, worked):
    problems = make_problems("train", 100, seed=0, long_share=long_share)
    assert len(problems) == 100
    assert sum(isinstance(p, Worked) for p in problems) == worked
    assert sum(isinstance(p, Problem) for p in problems) == 100 - worked


def test_the_two_variants_are_shuffled_together_and_the_worked_are_sums_and_products():
    problems = make_problems("train", 200, seed=0)
    kinds = [isinstance(p, Worked) for p in problems]
    assert kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True)
    worked = [p for p in problems if isinstance(p, Worked)]
    sums = [p for p in worked if p.op == "plus"]
    products = [p for p in worked if p.op == "times"]
    assert len(sums) + len(products) == 100 and 30 < len(sums) < 70
    assert {len(p.terms) for p in sums} == {3, 4, 5, 6} and {len(p.terms) for p in products} == {2}
    assert all(10 <= t < 100 for p in worked for t in p.terms)


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="long_share=1.5"):
        make_problems("train", 10, long_share=1.5)


def test_each_variant_asks_its_own_way_and_reads_back():
    short, worked = Problem(47, "plus", 38), Worked((23, 45, 67), "plus")
    assert short.messages() == [{"role": "user", "content": "What is 47 plus 38? Answer with a number."}]
    assert worked.messages() == [{"role": "user", "content": f"What is 23 plus 45 plus 67? {STEPS}"}]
    assert worked.answer == 135 and Worked((47, 38), "times").answer == 1786
    product = Worked((47, 38), "times")
    assert parse_problem(short.messages()) == short and parse_problem(worked.messages()) == worked
    assert parse_problem(product.messages()) == product  # two numbers: the steps instruction tells the variant
    assert parse_problem("What is 47 times 38? Answer with a number.") == Problem(47, "times", 38)
    assert parse_problem("What is 3 plus 4 times 5?") is None  # one operation per question
    assert parse_problem("hello") is None


def test_a_reference_solution_works_the_steps_and_ends_in_the_answer():
    assert Worked((23, 45, 67), "plus").solution() == (
        "Step 1: 23 + 45 = 68.\nStep 2: 68 + 67 = 135.\nAnswer: 135")
    assert Worked((47, 38), "times").solution() == (
        "Step 1: 47 x 38 = 47 x 30 + 47 x 8.\nStep 2: 47 x 30 = 1410.\nStep 3: 47 x 8 = 376.\n"
        "Step 4: 1410 + 376 = 1786.\nAnswer: 1786")


def test_the_reward_scores_both_variants():
    sum_, product, short = Worked((23, 45, 67), "plus"), Worked((47, 38), "times"), Problem(75, "minus", 57)
    long_right = ("First add the first two numbers: 23 + 45 = 68. Then add the third: 68 + 67 = 135. "
                  "Checking: 135 - 67 = 68 and 68 - 45 = 23, so the sum is right.\nAnswer: 135")
    long_wrong = long_right.replace("Answer: 135", "Answer: 136")
    prompts = [sum_.messages()] * 4 + [product.messages()] * 2 + [short.messages()] * 3 + ["not a question"]
    second_thoughts = "Answer: 135. No: 23 + 45 + 67 = 136.\nAnswer: 136"  # the last "Answer:" counts
    responses = [long_right, long_wrong, sum_.solution(), second_thoughts,
                 product.solution(), product.solution().replace("1786", "1787"),
                 "18", "75 - 57 = 18.", "75 - 57 = 28", "18"]
    assert reward(prompts, responses) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_the_files_hold_the_mix_and_read_back_as_the_trainer_reads_them(tmp_path):
    train, evals = write_problem_files(tmp_path, num_train=40, num_eval=12, seed=0, long_share=0.25)
    assert (train.name, evals.name) == ("long_tail_train.jsonl", "long_tail_eval.jsonl")
    prompts = read_prompt_texts(str(train), "prompt")  # chat messages, as a run reads them
    assert prompts == [p.messages() for p in make_problems("train", 40, seed=0, long_share=0.25)]
    assert sum(STEPS in chat[-1]["content"] for chat in prompts) == 10
    rows = [json.loads(line) for line in evals.read_text().splitlines()]
    assert len(rows) == 12 and set(rows[0]) == {"prompt", "answer"}
    assert reward([r["prompt"] for r in rows], [r["answer"] for r in rows]) == [1.0] * 12
    assert reward([r["prompt"] for r in rows], [str(int(r["answer"]) + 1) for r in rows]) == [0.0] * 12
    assert not {json.dumps(p) for p in prompts} & {json.dumps(r["prompt"]) for r in rows}


def test_toy_data_writes_the_files_the_config_trains_on(tmp_path):
    from ray_ppo.cli import main

    assert main(["toy-data", str(tmp_path), "--task", "long_tail", "--level", "1", "--num-prompts", "16",
                 "--num-eval", "6"]) == 0
    train, evals = tmp_path / "long_tail_train.jsonl", tmp_path / "long_tail_eval.jsonl"
    assert train.read_text().splitlines() == [json.dumps({"prompt": p.messages(), "answer": str(p.answer)})
                                              for p in make_problems("train", 16, seed=0, short_level=1)]
    assert len(evals.read_text().splitlines()) == 6

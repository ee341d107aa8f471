"""The calculator tool (an evaluator of the syntax tree, never ``eval``), reading tool calls, and the
built-in calculator task's environment and splits."""

import json

import pytest

from ray_ppo import cli
from ray_ppo.env import check_turn
from ray_ppo.tasks.calculator import EXAMPLE, CalculatorEnv, make_problems, messages
from ray_ppo.tools import calculate, parse_tool_calls


@pytest.mark.parametrize("expression, value", [
    ("347 * 29", "10063"), ("(1 + 2) * 3 / 4", "2.25"), ("-5 // 2", "-3"), ("2 ** 10", "1024"), ("7 % 3", "1"),
    ("10 / 4 * 2", "5"), ("1 / 3", "0.333333"),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "Call is not arithmetic"), ("a.b", "Attribute is not arithmetic"),
    ("x + 1", "Name is not arithmetic"), ("'a' * 3", "Constant is not arithmetic"), ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "above 64"), ("1e308 * 1e308", "out of range"), ("1 +", "cannot read"), ("1" * 201, "longer than 200"),
    ("[1, 2]", "List is not arithmetic"), ("(lambda: 1)()", "Call is not arithmetic"),
])
def test_the_calculator_refuses_what_is_not_arithmetic_and_what_grows_large(expression, why):
    out = calculate(expression)
    assert out.startswith("error: ") and why in out


def test_tool_calls_are_read_in_order_and_malformed_ones_reported():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> '
            '<tool_call>{not json}</tool_call><tool_call>["calculator"]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2*3"}}
    assert calls[1]["name"] is None and "not JSON" in calls[1]["error"]
    assert calls[2]["name"] is None and '{"name": "...", "arguments": {...}}' in calls[2]["error"]
    assert parse_tool_calls("The answer is 6.") == []


def test_the_calculator_environment_answers_calls_then_scores_the_answer():
    problem = make_problems("train", 1)[0]
    env = CalculatorEnv(messages(problem))
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{problem.a} * {problem.b}"}}}}</tool_call>'
    turn = check_turn(env.step(call))
    assert turn.observation == [{"role": "tool", "content": str(problem.answer)}] and not turn.done
    assert turn.info == {"tool_calls": 1} and turn.reward == 0
    unknown = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert unknown.observation[0]["content"] == "error: there is no tool named 'search'"
    assert env.step(f"The answer is {problem.answer}.") == check_turn(env.step(f"Answer: {problem.answer}"))
    assert env.step(f"Answer: {problem.answer}").reward == 1.0 and env.step("Answer: 1").reward == 0.0
    assert env.step("Answer: 1").done


def test_calculator_splits_are_disjoint_seeded_and_written_by_toy_data(tmp_path, capsys):
    train, evaluation = make_problems("train", 400), make_problems("eval", 100)
    assert not set(train) & set(evaluation) and len(set(train)) == 400
    assert EXAMPLE not in make_problems("train", 4000) + make_problems("eval", 1000)  # the prompt's worked example
    prompt = messages(train[0])
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert parse_tool_calls(prompt[2]["content"])[0]["arguments"] == {"expression": "123 * 45"}
    assert prompt[3]["content"] == "5535" and train[0].question in prompt[-1]["content"]
    assert make_problems("train", 50, seed=1) == make_problems("train", 50, seed=1) != make_problems("train", 50)
    assert all(100 <= p.a <= 999 and 10 <= p.b <= 99 and p.op == "times" for p in train)
    assert cli.main(["toy-data", str(tmp_path), "--task", "calculator", "--num-prompts", "20", "--num-eval", "5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "calculator_eval.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["prompt"] == messages(make_problems("eval", 5)[0]) and rows[0]["answer"].isdigit()
    assert str(tmp_path / "calculator_train.jsonl") in capsys.readouterr().out
    plain = [json.loads(line) for line in (tmp_path / "calculator_eval_no_tool.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in plain] == [p.messages() for p in make_problems("eval", 5)]  # no tool, same questions

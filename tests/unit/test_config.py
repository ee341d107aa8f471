"""Unit tests of ray_ppo.config: loading, overrides, type checks, validation messages, field docs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ray_ppo.config import (
    Config,
    ConfigError,
    LoraConfig,
    PPOConfig,
    check_strategy_available,
    dotted_field_docs,
    field_docs,
    load_config,
)

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "configs"


def config_error(fn, *args) -> str:
    """The message of the ConfigError raised by fn(*args); every message must be one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def colossalai_available(monkeypatch):
    """Pretend this machine has CUDA and the colossalai package (find_spec finds it; nothing is imported)."""
    torch = pytest.importorskip("torch")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "colossalai":
            return importlib.machinery.ModuleSpec("colossalai", None)
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# --- defaults and the public tree ---------------------------------------------------------------


def test_defaults_validate():
    cfg = Config()
    assert cfg.validate() is cfg
    assert Config.from_dict({}) == cfg
    assert load_config() == cfg


def test_tree_names_and_defaults_are_the_public_contract():
    assert Config().to_dict() == {
        "name": "ray_ppo",
        "seed": 0,
        "model": {
            "pretrained": "tiny", "tokenizer": None, "critic_pretrained": None, "reward_pretrained": None,
            "reward_fn": "ray_ppo.tasks.toy:reward", "dtype": "float32",
            "lora": {"rank": 0, "alpha": 16.0, "dropout": 0.0, "target_modules": None, "critic": False},
            "packing": True,
        },
        "data": {"path": None, "format": None, "prompt_column": "prompt", "max_prompt_len": 64,
                 "chat_template": False, "shuffle": True},
        "maker": {"num_makers": 1, "batch_size": 16, "max_new_tokens": 8, "temperature": 1.0, "top_k": 0,
                  "top_p": 1.0, "quantization": None, "dtype": None, "num_cpus": 0.5, "num_gpus": 0.0, "torch_threads": 1,
                  "wait_for_weights": False, "max_restarts": 3, "node_resource": None,
                  "engine": "hf", "engine_logprobs": None,
                  "vllm": {"gpu_memory_utilization": 0.3, "kv_cache_gib": 1.0, "enforce_eager": True, "dtype": None},
                  "samples_per_prompt": 1, "max_running": 0, "weight_updates": "in_flight", "kv_at_swap": "keep",
                  "schedule": "fifo"},
        "trainer": {"strategy": "ddp", "num_workers": 1, "use_gpu": False, "gpus_per_worker": 1.0,
                    "cpus_per_worker": 1.0, "node_resource": None,
                    "total_steps": 50, "time_budget_s": 0.0, "update_steps": 1, "train_batch_size": 32, "mini_batch_size": 16,
                    "ppo_epochs": 1, "actor_lr": 1e-5, "critic_lr": 1e-5, "weight_decay": 0.0,
                    "lr_schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0, "torch_threads": 1,
                    "checkpoint_every": 0, "keep_checkpoints": 2, "max_failures": 0, "pull_timeout_s": 120.0, "prefetch": True,
                    "max_nonfinite_updates": 10, "max_tokens_per_microbatch": 0, "autocast": False},
        "ppo": {"kl_coef": 0.05, "kl_estimator": "k1", "kl_target": None, "kl_horizon": 10000, "policy_loss": "ppo",
                "eps_clip": 0.2, "dual_clip": None, "value_clip": 0.2, "entropy_coef": 0.0, "gamma": 1.0, "lam": 0.95,
                "whiten_advantages": True, "max_staleness": 1, "off_policy": "decoupled", "proximal": "forward", "tis_cap": 2.0,
                "decoupled_cap": 5.0, "seq_mask_low": 0.999, "seq_mask_high": 1.001, "icepop_low": 0.5,
                "icepop_high": 5.0, "eps_clip_high": None, "loss_agg": "token_mean", "kl_in": "reward"},
        "algo": {"advantage": "gae", "group_norm_std": True, "overlong_buffer": 0, "overlong_penalty": 1.0,
                 "overlong_filter": False, "dynamic_sampling": False, "dynamic_sampling_max_draws": 3},
        "sync": {"bucket_mb": 256.0, "lora_only": False, "zero_copy": True},
        "topology": {"routing": "round_robin", "buffer_size": 0, "transport": "inline", "balance": "tokens"},
        "logging": {"output_dir": None, "progress": True, "tensorboard": True, "report_every": 10,
                    "wandb": False, "mlflow": False, "project": "ray_ppo", "samples_every": 10},
        "eval": {"path": None, "every": 10, "num_prompts": 100, "greedy": True, "samples_per_prompt": 1,
                 "reward_fn": None, "max_new_tokens": None},
        "env": {"cls": None, "max_turns": 4, "max_tokens": 256, "step_timeout_s": 30.0, "pipeline": 2},
        "agent": {"fn": None, "timeout_s": 300.0, "call_timeout_s": 120.0, "host": None},
        "toy": {"num_prompts": 512, "prompt_len": 6, "seed": 0},
    }


def test_derived_properties():
    cfg = Config()
    assert cfg.output_dir == "runs/ray_ppo"
    assert cfg.buffer_size == 64  # 2 * train_batch_size
    cfg = cfg.with_overrides({"logging.output_dir": "/tmp/run", "topology.buffer_size": 40})
    assert cfg.output_dir == "/tmp/run"
    assert cfg.buffer_size == 40


# --- YAML files ---------------------------------------------------------------------------------


def test_load_yaml(tmp_path):
    path = write(tmp_path, """
name: demo
model:
  lora: {rank: 8, target_modules: [q_proj, v_proj]}
trainer:
  actor_lr: 1e-5        # PyYAML alone would read this as a string
  critic_lr: 2.0e5
ppo:
  kl_coef: 1            # an int is fine for a float field
  value_clip: null
""")
    cfg = load_config(path)
    assert cfg.name == "demo"
    assert cfg.model.lora == LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])
    assert cfg.trainer.actor_lr == 1e-5 and cfg.trainer.critic_lr == 2.0e5
    assert cfg.ppo.kl_coef == 1.0 and isinstance(cfg.ppo.kl_coef, float)
    assert cfg.ppo.value_clip is None
    assert cfg.ppo.eps_clip == PPOConfig().eps_clip  # keys left out keep their defaults
    assert load_config(str(path)) == cfg


def test_empty_yaml_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == Config()


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    message = config_error(load_config, path)
    assert "not found" in message and str(path) in message


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: demo\nppo:\n  kl_coef: [0.1, 0.2\n  eps_clip: 0.2\n")
    message = config_error(load_config, path)
    assert str(path) in message and "invalid YAML" in message and "line 4" in message


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    message = config_error(load_config, write(tmp_path, "- name\n- seed\n"))
    assert "top level must be a mapping" in message and "list" in message


def test_yaml_duplicate_key_is_rejected(tmp_path):
    message = config_error(load_config, write(tmp_path, "ppo:\n  kl_coef: 0.1\n  kl_coef: 0.2\n"))
    assert "duplicate key 'kl_coef'" in message and "line 3" in message


# --- dotted overrides ---------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, expected", [
    ("ppo.kl_coef=0.1", "ppo.kl_coef", 0.1),
    (" ppo.kl_coef = 0.3 ", "ppo.kl_coef", 0.3),
    ("trainer.total_steps=7", "trainer.total_steps", 7),
    ("trainer.actor_lr=3e-4", "trainer.actor_lr", 3e-4),
    ("ppo.kl_coef=1", "ppo.kl_coef", 1.0),
    ("ppo.value_clip=null", "ppo.value_clip", None),
    ("ppo.kl_target=0.5", "ppo.kl_target", 0.5),
    ("maker.wait_for_weights=true", "maker.wait_for_weights", True),
    ("data.shuffle=false", "data.shuffle", False),
    ("model.lora.target_modules=[q_proj,v_proj]", "model.lora.target_modules", ["q_proj", "v_proj"]),
    ("model.reward_fn=my.module:score", "model.reward_fn", "my.module:score"),
    ("name=2024", "name", "2024"),  # a string field keeps the text of a number
    ("data.path=prompts.csv", "data.path", "prompts.csv"),
])
def test_override_values_are_parsed_as_yaml(override, key, expected):
    value = load_config(None, [override]).get(key)
    assert value == expected and type(value) is type(expected)


def test_overrides_win_over_the_file_in_order(tmp_path):
    path = write(tmp_path, "ppo:\n  kl_coef: 0.2\nseed: 1\n")
    cfg = load_config(path, ["ppo.kl_coef=0.3", "model.lora.rank=4", "model.lora.rank=8"])
    assert (cfg.ppo.kl_coef, cfg.seed, cfg.model.lora.rank) == (0.3, 1, 8)


def test_single_override_string_is_one_override():
    assert load_config(None, "seed=3").seed == 3


@pytest.mark.parametrize("override, fragments", [
    ("ppo.kl_coef", ["bad override 'ppo.kl_coef'", "key=value"]),
    ("=0.1", ["key=value"]),
    ("ppo.kl_cof=0.1", ["unknown key 'ppo.kl_cof'; did you mean 'ppo.kl_coef'?"]),
    ("ppo=1", ["ppo is a section", "ppo.kl_coef="]),
    ("seed.x=1", ["unknown key 'seed.x': seed is a setting, not a section"]),
    ("ppo.eps_clip=abc", ["ppo.eps_clip: expected a number, got 'abc'"]),
    ("trainer.total_steps=[1", ["bad override", "not valid YAML"]),
])
def test_bad_overrides(override, fragments):
    message = config_error(load_config, None, [override])
    for fragment in fragments:
        assert fragment in message


def test_with_overrides_returns_a_new_validated_config():
    base = Config()
    cfg = base.with_overrides({"ppo.kl_coef": 0.1, "seed": 3, "model.lora.target_modules": ("q_proj",)})
    assert (cfg.ppo.kl_coef, cfg.seed, cfg.model.lora.target_modules) == (0.1, 3, ["q_proj"])
    assert base == Config()
    assert "ppo.eps_clip=0.0" in config_error(base.with_overrides, {"ppo.eps_clip": 0})
    assert "did you mean 'ppo.kl_coef'" in config_error(base.with_overrides, {"ppo.kl_cof": 0.1})


def test_get_by_dotted_name():
    cfg = Config()
    assert cfg.get("ppo.kl_coef") == 0.05
    assert cfg.get("model.lora") is cfg.model.lora
    assert cfg.get("name") == "ray_ppo"
    assert config_error(cfg.get, "model.lora.rnak") == "unknown key 'model.lora.rnak'; did you mean 'model.lora.rank'?"


# --- unknown keys and types ---------------------------------------------------------------------


@pytest.mark.parametrize("data, expected", [
    ({"ppo": {"kl_cof": 0.1}}, "unknown key 'ppo.kl_cof'; did you mean 'ppo.kl_coef'?"),
    ({"model": {"lora": {"rnak": 8}}}, "unknown key 'model.lora.rnak'; did you mean 'model.lora.rank'?"),
    ({"sed": 1}, "unknown key 'sed'; did you mean 'seed'?"),
    ({"kl_coef": 0.1}, "unknown key 'kl_coef'; did you mean 'ppo.kl_coef'?"),
])
def test_unknown_key_did_you_mean(data, expected):
    assert config_error(Config.from_dict, data) == expected


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    message = config_error(Config.from_dict, {"sync": {"zzzz": 1}})
    assert message == "unknown key 'sync.zzzz'; valid keys under sync: bucket_mb, lora_only, zero_copy"
    assert "valid keys at the top level: name, seed, model" in config_error(Config.from_dict, {"zzzz": 1})


@pytest.mark.parametrize("data, expected", [
    ({"ppo": {"eps_clip": "abc"}}, "ppo.eps_clip: expected a number, got 'abc'"),
    ({"ppo": {"eps_clip": True}}, "ppo.eps_clip: expected a number, got True"),
    ({"seed": True}, "seed: expected an integer, got True"),
    ({"seed": 1.5}, "seed: expected an integer, got 1.5"),
    ({"seed": None}, "seed: expected an integer, got null"),
    ({"name": 3}, "name: expected a string, got 3"),
    ({"data": {"shuffle": 1}}, "data.shuffle: expected true or false, got 1"),
    ({"ppo": {"dual_clip": "2"}}, "ppo.dual_clip: expected a number or null, got '2'"),
    ({"model": {"lora": {"target_modules": "q_proj"}}},
     "model.lora.target_modules: expected a list of strings or null, got 'q_proj'"),
    ({"model": {"lora": {"target_modules": ["q_proj", 3]}}}, "model.lora.target_modules[1]: expected a string, got 3"),
    ({"ppo": 3}, "ppo: expected a mapping of settings (key: value), got 3"),
    ({"ppo": None}, "ppo: expected a mapping of settings (key: value), got null"),
])
def test_wrong_types_name_field_value_and_type(data, expected):
    assert config_error(Config.from_dict, data) == expected


def test_from_dict_needs_a_mapping():
    assert "expected a mapping" in config_error(Config.from_dict, ["seed", 1])


def test_a_directly_built_config_is_checked():
    assert config_error(lambda: Config(seed="1")) == "seed: expected an integer, got '1'"
    assert config_error(lambda: LoraConfig(rank=-1)).startswith("model.lora.rank=-1 is invalid: must be >= 0")


# --- value rules --------------------------------------------------------------------------------

POSITIVE = [
    "data.max_prompt_len", "maker.num_makers", "maker.batch_size", "maker.max_new_tokens", "maker.temperature",
    "maker.torch_threads", "trainer.num_workers", "trainer.cpus_per_worker", "trainer.total_steps",
    "trainer.update_steps", "trainer.train_batch_size", "trainer.mini_batch_size", "trainer.ppo_epochs",
    "trainer.actor_lr", "trainer.critic_lr", "trainer.torch_threads", "trainer.pull_timeout_s", "ppo.kl_horizon",
    "ppo.value_clip", "model.lora.alpha", "sync.bucket_mb", "toy.num_prompts", "toy.prompt_len", "logging.report_every",
    "trainer.keep_checkpoints",
]
NON_NEGATIVE = [
    "model.lora.rank", "maker.top_k", "maker.num_cpus", "maker.num_gpus", "trainer.weight_decay",
    "trainer.warmup_steps", "trainer.max_grad_norm", "trainer.checkpoint_every", "ppo.kl_coef",
    "ppo.entropy_coef", "ppo.max_staleness", "topology.buffer_size", "trainer.max_nonfinite_updates",
    "maker.max_restarts", "trainer.max_failures", "logging.samples_every",
]


@pytest.mark.parametrize("value", [0, 1, 5, -0.1])
def test_eps_clip_is_a_fraction(value):
    message = config_error(Config().with_overrides, {"ppo.eps_clip": value})
    assert message == (f"ppo.eps_clip={float(value)!r} is invalid: must be in (0, 1); "
                       f"set e.g. ppo.eps_clip=0.2 (the default)")


@pytest.mark.parametrize("key", POSITIVE)
def test_positive_fields(key):
    message = config_error(Config().with_overrides, {key: 0})
    assert message.startswith(f"{key}=0") and "must be > 0" in message and f"set e.g. {key}=" in message


@pytest.mark.parametrize("key", NON_NEGATIVE)
def test_non_negative_fields(key):
    message = config_error(Config().with_overrides, {key: -1})
    assert message.startswith(f"{key}=-1") and "must be >= 0" in message and f"set e.g. {key}=" in message


@pytest.mark.parametrize("overrides, fragments", [
    ({"name": " "}, ["name=' '", "non-empty", "set e.g. name=ray_ppo (the default)"]),
    ({"seed": -1}, ["seed=-1", "[0, 2**32)", "set e.g. seed=0"]),
    ({"model.pretrained": ""}, ["model.pretrained=''", "set e.g. model.pretrained=tiny"]),
    ({"model.tokenizer": ""}, ["model.tokenizer=''", "set model.tokenizer=null to use model.pretrained"]),
    ({"model.critic_pretrained": ""}, ["model.critic_pretrained=''", "set model.critic_pretrained=null"]),
    ({"model.reward_pretrained": " "}, ["model.reward_pretrained=' '", "set model.reward_pretrained=null"]),
    ({"model.reward_fn": "ray_ppo.tasks.toy.reward"},
     ["model.reward_fn='ray_ppo.tasks.toy.reward'", "module:function", "model.reward_fn=ray_ppo.tasks.toy:reward"]),
    ({"model.reward_fn": None}, ["model.reward_fn and model.reward_pretrained are both null",
                                 "set model.reward_fn=ray_ppo.tasks.toy:reward or model.reward_pretrained="]),
    ({"model.dtype": "fp8"}, ["model.dtype='fp8'", "one of float32, bfloat16, float16", "model.dtype=float32"]),
    ({"model.lora.dropout": 1.0}, ["model.lora.dropout=1.0", "[0, 1)", "model.lora.dropout=0.0"]),
    ({"model.lora.target_modules": []}, ["model.lora.target_modules=[]", "model.lora.target_modules=[q_proj,v_proj]",
                                         "model.lora.target_modules=null"]),
    ({"model.lora.critic": True}, ["model.lora.critic=true needs LoRA",
                                   "set model.lora.rank=8 or model.lora.critic=false"]),
    ({"sync.lora_only": True}, ["sync.lora_only=true needs LoRA, but model.lora.rank=0",
                                "set model.lora.rank=8 or sync.lora_only=false"]),
    ({"data.path": ""}, ["data.path=''", "data.path=null"]),
    ({"data.format": "xml"}, ["data.format='xml'", "one of csv, parquet, json", "data.format=null"]),
    ({"data.prompt_column": ""}, ["data.prompt_column=''", "data.prompt_column=prompt"]),
    ({"maker.top_p": 0}, ["maker.top_p=0.0", "(0, 1]", "maker.top_p=1.0"]),
    ({"maker.top_p": 1.5}, ["maker.top_p=1.5", "(0, 1]"]),
    ({"maker.quantization": "int4"}, ["maker.quantization='int4'", "one of int8", "maker.quantization=null"]),
    ({"maker.quantization": "int8", "maker.num_gpus": 1}, ["maker.quantization='int8'", "runs on CPU only",
                                                          "maker.num_gpus=1", "set maker.quantization=null",
                                                          "or maker.num_gpus=0"]),
    ({"trainer.strategy": "deepspeed"}, ["trainer.strategy='deepspeed'", "ddp, fsdp, colossalai_zero2,",
                                         "colossalai_gemini_cpu", "trainer.strategy=ddp"]),
    ({"trainer.lr_schedule": "step"}, ["trainer.lr_schedule='step'", "constant, linear, cosine"]),
    ({"trainer.mini_batch_size": 64}, ["trainer.mini_batch_size=64 is larger than trainer.train_batch_size=32",
                                       "set trainer.mini_batch_size=32"]),
    ({"trainer.train_batch_size": 30}, ["trainer.train_batch_size=30 is not a multiple of trainer.mini_batch_size=16",
                                        "set trainer.train_batch_size=32 or trainer.mini_batch_size=15"]),
    ({"ppo.kl_estimator": "k4"}, ["ppo.kl_estimator='k4'", "one of k1, k2, k3"]),
    ({"ppo.kl_target": 0}, ["ppo.kl_target=0.0", "> 0", "ppo.kl_target=null"]),
    ({"ppo.dual_clip": 1.0}, ["ppo.dual_clip=1.0", "must be > 1", "ppo.dual_clip=3.0", "ppo.dual_clip=null"]),
    ({"ppo.value_clip": -0.1}, ["ppo.value_clip=-0.1", "ppo.value_clip=0.2", "ppo.value_clip=null"]),
    ({"ppo.gamma": 1.1}, ["ppo.gamma=1.1", "[0, 1]", "ppo.gamma=1.0"]),
    ({"ppo.lam": -0.1}, ["ppo.lam=-0.1", "[0, 1]", "ppo.lam=0.95"]),
    ({"ppo.policy_loss": "grpo"}, ["ppo.policy_loss='grpo'", "one of ppo, gspo, cispo", "ppo.policy_loss=ppo"]),
    ({"ppo.policy_loss": "gspo", "ppo.dual_clip": 3.0}, ["ppo.dual_clip=3", "ppo.policy_loss=gspo has no such term",
                                                         "set ppo.dual_clip=null or ppo.policy_loss=ppo"]),
    ({"ppo.off_policy": "seq_is"}, ["ppo.off_policy='seq_is'", "seq_tis, seq_mask, icepop"]),
    ({"ppo.icepop_low": 5.0}, ["ppo.icepop_low=5.0", "(0, 1)", "ppo.icepop_low=0.5"]),
    ({"ppo.icepop_high": 0.5}, ["ppo.icepop_high=0.5", "> 1", "ppo.icepop_high=5.0"]),
    ({"ppo.seq_mask_low": 1.0}, ["ppo.seq_mask_low=1.0", "(0, 1)", "ppo.seq_mask_low=0.999"]),
    ({"ppo.seq_mask_high": 1.0}, ["ppo.seq_mask_high=1.0", "> 1", "ppo.seq_mask_high=1.001"]),
    ({"algo.overlong_buffer": 8}, ["algo.overlong_buffer=8 must be below maker.max_new_tokens=8",
                                   "set algo.overlong_buffer=2 or 0 (off)"]),
    ({"algo.overlong_penalty": -1.0}, ["algo.overlong_penalty=-1.0", ">= 0"]),
    ({"algo.overlong_filter": True, "env.cls": "ray_ppo.tasks.calculator:CalculatorEnv"},
     ["algo.overlong_filter shapes single completions", "env.cls='ray_ppo.tasks.calculator:CalculatorEnv'",
      "set algo.overlong_buffer=0 and algo.overlong_filter=false"]),
    ({"topology.routing": "random"}, ["topology.routing='random'", "round_robin, modulo"]),
    ({"topology.transport": "shm"}, ["topology.transport='shm'", "inline, ref"]),
    ({"topology.buffer_size": 8}, ["topology.buffer_size=8 is smaller than trainer.train_batch_size=32",
                                   "set topology.buffer_size=0", "topology.buffer_size=32 or more"]),
    ({"logging.output_dir": ""}, ["logging.output_dir=''", "logging.output_dir=null"]),
])
def test_value_rules_name_field_value_and_fix(overrides, fragments):
    message = config_error(Config().with_overrides, overrides)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("overrides", [
    {"model.reward_fn": None, "model.reward_pretrained": "path/to/rm"},
    {"model.lora.rank": 8, "sync.lora_only": True, "model.lora.critic": True},
    {"trainer.train_batch_size": 48, "trainer.mini_batch_size": 48, "topology.buffer_size": 48},
    {"ppo.dual_clip": 3.0, "ppo.kl_target": 6.0, "ppo.value_clip": None, "maker.quantization": "int8"},
    {"maker.num_gpus": 0.5, "maker.quantization": None},
    {"maker.top_p": 1.0, "ppo.gamma": 0.0, "ppo.lam": 1.0, "model.lora.dropout": 0.0, "seed": 2**32 - 1},
    {"ppo.policy_loss": "cispo", "ppo.eps_clip_high": 4.0, "ppo.off_policy": "icepop"},
    {"algo.overlong_buffer": 7, "algo.overlong_filter": True, "algo.overlong_penalty": 0.0},
    {"ppo.policy_loss": "gspo", "ppo.eps_clip": 3e-4, "ppo.eps_clip_high": 4e-4, "ppo.off_policy": "seq_mask"},
])
def test_valid_edge_values_pass(overrides):
    cfg = Config().with_overrides(overrides)
    assert all(cfg.get(key) == value for key, value in overrides.items())


# --- ColossalAI availability --------------------------------------------------------------------


def test_colossalai_without_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = config_error(Config().with_overrides, {"trainer.strategy": "colossalai_zero2", "trainer.use_gpu": True})
    assert message == ("trainer.strategy='colossalai_zero2' needs CUDA, and none is available here; "
                       "use trainer.strategy=fsdp (ZeRO-3 style sharding on CPU or GPU) or ddp")


def test_colossalai_without_the_package(colossalai_available, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "colossalai" else real_find_spec(name, *a, **k))
    message = config_error(check_strategy_available, "colossalai_gemini")
    assert message == ("trainer.strategy='colossalai_gemini' needs the colossalai package; "
                       "install ray_ppo[colossalai] on a CUDA machine, or use trainer.strategy=fsdp")


def test_colossalai_needs_use_gpu(colossalai_available):
    message = config_error(Config().with_overrides, {"trainer.strategy": "colossalai_zero2_cpu"})
    assert "trainer.use_gpu=false" in message and "set trainer.use_gpu=true" in message
    cfg = Config().with_overrides({"trainer.strategy": "colossalai_zero2_cpu", "trainer.use_gpu": True})
    assert cfg.trainer.strategy == "colossalai_zero2_cpu"


def test_other_strategies_need_nothing(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_strategy_available("ddp") is None
    assert Config().with_overrides({"trainer.strategy": "fsdp"}).trainer.strategy == "fsdp"


# --- round trips, docs, messages, imports -------------------------------------------------------


def test_to_dict_from_dict_round_trip(tmp_path):
    cfg = Config().with_overrides({
        "name": "rt", "model.lora.rank": 4, "model.lora.target_modules": ["c_attn"], "ppo.kl_target": 6.0,
        "ppo.value_clip": None, "trainer.actor_lr": 3e-6, "data.format": "parquet", "maker.quantization": "int8",
    })
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    assert load_config(write(tmp_path, cfg.to_yaml())) == cfg


def _config_classes(cls: type = Config):
    yield cls
    for info in cls.model_fields.values():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _config_classes(info.annotation)


@pytest.mark.parametrize("cls", list(_config_classes()), ids=lambda cls: cls.__name__)
def test_every_field_has_a_one_line_doc(cls):
    docs = field_docs(cls)
    assert list(docs) == list(cls.model_fields)
    for name, doc in docs.items():
        assert doc.strip(), f"{cls.__name__}.{name} has no docstring"
        assert "\n" not in doc, f"{cls.__name__}.{name} has a multi-line docstring"


def test_dotted_field_docs_cover_the_tree():
    docs = dotted_field_docs()
    assert len(list(_config_classes())) == 16  # the sections, algo, agent and maker.vllm included
    assert docs["ppo.kl_coef"] == field_docs(PPOConfig)["kl_coef"]
    assert docs["model.lora.rank"] == field_docs(LoraConfig)["rank"]
    assert {key.split(".")[0] for key in docs} == set(field_docs(Config))
    assert all(docs.values())


def test_messages_are_single_line():
    assert str(ConfigError("first\n  second")) == "first second"
    assert "\n" not in config_error(Config.from_dict, {"name": "a\nb", "seed": "x\ny"})


def test_config_module_imports_neither_torch_nor_ray():
    code = ("import sys; from ray_ppo.config import load_config; load_config(None, ['trainer.strategy=fsdp']); "
            "print(sorted(m for m in ('torch', 'ray', 'colossalai') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_shipped_configs_validate(colossalai_available, monkeypatch):
    # Hardware and packages are patched in (CUDA, colossalai, vllm): this checks each config's keys
    # and values, not this machine.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, **kwargs: importlib.machinery.ModuleSpec(
        name, None) if name == "vllm" else find_spec(name, *args, **kwargs))
    assert not list(CONFIGS.glob("*.yml")), "name shipped configs *.yaml so that this test loads them"
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        assert Config.from_dict(cfg.to_dict()) == cfg, path


def test_code_that_dispatches_on_a_choice_knows_exactly_the_config_s_names():
    torch = pytest.importorskip("torch")
    from ray_ppo.algo import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY_MODES, POLICY_LOSSES, functional
    from ray_ppo.config import choices
    from ray_ppo.models import hf, quantize

    assert tuple(functional.KL_ESTIMATORS) == choices.KL_ESTIMATORS
    assert (ADVANTAGE_ESTIMATORS, OFF_POLICY_MODES, LOSS_AGGREGATIONS, POLICY_LOSSES) == (
        choices.ADVANTAGES, choices.OFF_POLICY, choices.LOSS_AGGS, choices.POLICY_LOSSES)
    assert hf.DTYPES == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert quantize.QUANTIZATIONS == choices.QUANTIZATIONS == ("int8",)
    assert "one of " + ", ".join(choices.STRATEGIES) in config_error(Config().with_overrides, {"trainer.strategy": "x"})


def test_the_maker_section_is_the_sampling_params():
    from ray_ppo.config import SamplingParams

    cfg = Config().with_overrides({"maker.max_new_tokens": 5, "maker.top_k": 3})
    assert isinstance(cfg.maker, SamplingParams)
    assert SamplingParams(max_new_tokens=5, top_k=3) == SamplingParams(
        **{key: getattr(cfg.maker, key) for key in SamplingParams.model_fields})
    assert config_error(lambda: SamplingParams(top_p=0)).startswith("maker.top_p=0.0 is invalid: must be in (0, 1]")

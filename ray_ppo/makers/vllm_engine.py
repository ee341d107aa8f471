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
  - ``continuous_batcher(...)``: a streaming maker's (``maker.max_running`` > 0) ``VllmBatcher``,
    which drives vLLM's own scheduler step by step; a push loads between two steps, running
    requests kept.

vLLM is imported only here, and only when a maker builds an engine.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ray_ppo.config import VLLM_INSTALL_HINT, Config
from ray_ppo.models.continuous import Finished, KvAtSwap, RunningSequence, Schedule, Slots, longest_first
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
                 on_gpu: bool = False, temperature: float = 1.0, logprobs_mode: str | None = None,
                 streaming: bool = False):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self._on_thread(self._start, model_path, dtype, seed, max_model_len, gpu_memory_utilization, kv_cache_gib,
                        enforce_eager, on_gpu, temperature, logprobs_mode, streaming)
        self.version = 0
        self.batcher: VllmBatcher | None = None  # a streaming maker's: its requests may be running in the engine
        self._ids = itertools.count()

    def _on_thread(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the engine's thread; its result (or its exception) here."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _start(self, model_path: str, dtype: str, seed: int, max_model_len: int, gpu_memory_utilization: float,
               kv_cache_gib: float, enforce_eager: bool, on_gpu: bool, temperature: float,
               logprobs_mode: str | None, streaming: bool) -> None:
        vllm = _import_vllm()
        from vllm.sampling_params import RequestOutputKind

        kwargs = {}
        if streaming:
            # Async scheduling (a GPU default) runs the next step while the last one's tokens are
            # read out: a weight load between two steps would land inside one, and tokens would
            # be reported a step after they were sampled (under the wrong version).
            kwargs["async_scheduling"] = False
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
        self._sampling_cls, self._output_kind = vllm.SamplingParams, RequestOutputKind

    def sampling(self, params: SamplingParams, ends: Sequence[int], greedy: bool = False, max_tokens: int | None = None,
                 kind: str = "FINAL_ONLY"):
        """vLLM's sampling settings for ``params``: the sampled token's log-prob with each token,
        ending at a token of ``ends`` (kept) or after ``max_tokens`` (None: ``params.max_new_tokens``);
        ``kind``: the ``RequestOutputKind`` (FINAL_ONLY: one output when the request ends; DELTA:
        each step's new tokens, for a ``VllmBatcher``)."""
        return self._sampling_cls(
            n=1, max_tokens=max_tokens or params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
            top_k=params.top_k if params.top_k > 0 and not greedy else -1, top_p=1.0 if greedy else params.top_p,
            logprobs=0, stop_token_ids=list(ends) or None, ignore_eos=not ends, detokenize=False,
            output_kind=self._output_kind[kind])

    def continuous_batcher(self, actor: nn.Module, params: SamplingParams, pad_token_id: int, stop_ids: Iterable[int],
                           **kwargs) -> VllmBatcher:
        """A streaming maker's batcher (``maker.max_running`` > 0), built as it builds a
        ``ContinuousBatcher``; ``actor`` (the HF copy) is not used: the engine holds its own weights."""
        self.batcher = VllmBatcher(self, params, stop_ids, **kwargs)
        return self.batcher

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, pad_token_id: int,
                 eos_token_id: int | Sequence[int] | None, greedy: bool = False) -> Rollout:
        """One response per prompt, as ``ray_ppo.models.generate`` returns it (on the CPU), plus
        ``log_probs``: vLLM's log-prob of each sampled token (0 on padding). A response ends at its
        first token in ``eos_token_id`` (one id or several), or at ``params.max_new_tokens``.
        ``greedy``: the most likely token at each step (vLLM's temperature 0)."""
        sampling = self.sampling(params, end_ids(eos_token_id), greedy)
        outputs = self._on_thread(self._generate, prompts, sampling)
        responses = [out.outputs[0] for out in outputs]  # each ends at its first end token or at max_new_tokens
        ids = [list(r.token_ids) for r in responses]
        sampled = [[r.logprobs[t][tok].logprob for t, tok in enumerate(row)] for r, row in zip(responses, ids)]
        return rollout_of_responses(prompts, ids, sampled, pad_token_id)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling) -> list:
        """On the engine's thread: step the engine until every prompt is answered; their final
        outputs in order. ``LLM.generate`` would step until no request is left, a streaming
        batcher's too, and swallow their outputs (an evaluation mid-stream): those go to it."""
        engine = self.llm.llm_engine
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):  # salted with the version: no block older weights computed
            engine.add_request(request_id, {"prompt_token_ids": list(prompt), "cache_salt": str(self.version)},
                               sampling)
        done = {}
        while len(done) < len(ids):
            others = []
            for output in engine.step():
                if output.request_id.startswith("generate-"):
                    done[output.request_id] = output
                else:
                    others.append(output)
            if others and self.batcher is not None:
                self.batcher.absorb(others)
        return [done[request_id] for request_id in ids]

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load a complete actor state (Hugging Face names) and tag the engine with ``version``;
        returns the seconds it took. The caller holds the maker's model lock."""
        start = time.perf_counter()
        self._on_thread(self._load, list(weights), version)
        self.version = version
        return time.perf_counter() - start

    def _load(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.llm_engine.has_unfinished_requests():
            # A streaming batcher's running requests hold blocks, so a reset would fail; its requests
            # carry the version they started under as their cache salt instead (VllmBatcher).
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


class VllmBatcher(Slots):
    """Continuous batching in vLLM's own scheduler, driven one engine step at a time, with the
    interface of ``ray_ppo.models.continuous.ContinuousBatcher`` (``submit``, ``step``, ``swap``,
    ``busy``, ``waiting``, ``rows`` and its slot and cache counts), for a streaming maker.

    Responsibilities: keep at most ``max_running`` requests in the engine, admitting waiting ones
    (``schedule``: fifo, or longest first as ``ContinuousBatcher`` ranks them) as requests end;
    at each ``step``, one ``LLMEngine.step()``, each new token recorded with its sampled log-prob
    and the version of the weights that sampled it; at a ``swap``, the running requests' cache
    kept (``kv_at_swap="keep"``: vLLM keeps it across a weight load) or recomputed
    (``"recompute"``: each running request aborted and re-added with its prompt and tokens so far
    as its prompt, so the next step prefills that context with the new weights).

    vLLM's scheduler batches a step: an admitted prompt is prefilled beside the running requests'
    decode (in chunks, if long) and samples its first token in the step its prefill completes.
    A request's prompt blocks are salted with the version it started under (``cache_salt``), so
    no request reuses prefix-cache blocks that older weights computed (a prefix cache reset
    fails while requests hold blocks). Every engine call runs on the engine's thread.

    Args:
        engine: the maker's engine (its weights change through ``VllmEngine.load``).
        params: the sampling settings (temperature, top_k, top_p, max_new_tokens).
        stop_ids: the ids that end a response; the stop token is kept.
        max_running: how many requests the engine runs at most.
        kv_at_swap: ``"keep"`` or ``"recompute"`` the running requests' cache at a weight swap.
        greedy: the most likely token at each step instead of a sample.
        version: the policy version of the weights the engine holds now.
        schedule: ``"fifo"`` or ``"longest_first"`` (by ``Request.expected_len``).
    """

    def __init__(self, engine: VllmEngine, params: SamplingParams, stop_ids: Iterable[int], max_running: int,
                 kv_at_swap: KvAtSwap = "keep", greedy: bool = False, version: int = 0, schedule: Schedule = "fifo"):
        super().__init__(max_running, kv_at_swap, schedule, version)
        if engine.llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
            raise EngineError("a VllmBatcher steps the engine between weight loads, which async scheduling "
                              "overlaps; build the engine with VllmEngine(..., streaming=True)")
        self.engine, self.params, self.greedy = engine, params, greedy
        self.stop_ids = sorted(set(stop_ids))
        self._running: dict[str, RunningSequence] = {}  # request id in the engine -> its sequence
        self._finished: list[Finished] = []  # ended, not yet returned by step
        self._ids = itertools.count()

    @property
    def rows(self) -> list[RunningSequence]:
        """The running sequences."""
        return list(self._running.values())

    @property
    def busy(self) -> bool:
        """Whether any sequence is running or waiting (or ended, not yet returned by ``step``)."""
        return bool(self._running or self.waiting or self._finished)

    def step(self, admit: bool = True) -> list[Finished]:
        """Admit waiting requests into free slots, then one engine step; returns the sequences that
        ended (a stop id, their cap, or the engine's context length), in any order.

        Args:
            admit: False admits nothing (the running requests drain, e.g. before a weight swap).
        """
        added = self._admit() if admit else []
        if not self._running:
            finished, self._finished = self._finished, []
            return finished
        self.slot_steps += len(self._running)
        self.absorb(self.engine._on_thread(self._add_and_step, added))
        self.steps += 1
        finished, self._finished = self._finished, []
        return finished

    def absorb(self, outputs: Sequence) -> None:
        """Record the new tokens of an engine step's outputs for this batcher's requests (its own
        steps', or those of a ``VllmEngine.generate`` beside it); the ended ones go out at the next ``step``."""
        stop = set(self.stop_ids)
        for output in outputs:
            row = self._running.get(output.request_id)
            if row is None:  # a request a recompute aborted
                continue
            completion = output.outputs[0]
            new = list(completion.token_ids)
            row.tokens += new
            row.log_probs += [completion.logprobs[i][token].logprob for i, token in enumerate(new)]
            row.versions += [self.version] * len(new)
            if output.finished:
                del self._running[output.request_id]
                self._finished.append(Finished(row.request.key, list(row.request.prompt), row.tokens, row.log_probs,
                                               row.versions, stopped=bool(row.tokens) and row.tokens[-1] in stop,
                                               swaps=row.swaps))

    def swap(self, apply: Callable[[], None], version: int) -> None:
        """Between two steps: ``apply()``, then the tokens sampled from the next step on count as
        ``version``'s. The engine's weights change through ``VllmEngine.load`` (before the next step).

        Args:
            apply: changes the weights (the worker's HF copy takes the push; the engine loads after).
            version: the policy version of the new weights.
        """
        apply()
        rows = self._swapped(version)
        if rows and self.kv_at_swap == "recompute":
            self.engine._on_thread(self.engine.llm.llm_engine.abort_request, list(self._running))
            self._running = {}
            self.engine._on_thread(self._add_and_step, [self._entry(row, [*row.request.prompt, *row.tokens])
                                                        for row in rows], step=False)

    def _admit(self) -> list[tuple[str, dict, object]]:
        """The waiting requests that fit into the free slots, as engine requests (now running)."""
        free = self.max_running - len(self._running)
        if self.schedule == "longest_first" and free > 0 and self.waiting:
            self.waiting = longest_first(self.waiting)
        admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        return [self._entry(RunningSequence(r, r.max_new_tokens or self.params.max_new_tokens), list(r.prompt))
                for r in admitted]

    def _entry(self, row: RunningSequence, context: list[int]) -> tuple[str, dict, object]:
        """``row`` as a new engine request (registered as running) that continues from ``context``."""
        request_id = str(next(self._ids))
        self._running[request_id] = row
        sampling = self.engine.sampling(self.params, self.stop_ids, self.greedy, row.cap - len(row.tokens), "DELTA")
        return request_id, {"prompt_token_ids": context, "cache_salt": str(self.version)}, sampling

    def _add_and_step(self, added: list[tuple[str, dict, object]], step: bool = True) -> list:
        """On the engine's thread: add ``added``, then one engine step (its request outputs)."""
        llm_engine = self.engine.llm.llm_engine
        for request_id, prompt, sampling in added:
            llm_engine.add_request(request_id, prompt, sampling)
        return llm_engine.step() if step else []


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
                      enforce_eager=opts.enforce_eager, on_gpu=on_gpu, temperature=cfg.maker.temperature,
                      streaming=cfg.maker.max_running > 0)


__all__ = ["EngineError", "VllmBatcher", "VllmEngine", "build_engine", "engine_actor_state", "hf_weights", "transposed_weights"]


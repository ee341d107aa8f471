"""Maker generation on long-tail answers: batch-synchronous HF ``generate`` (what a maker runs
batch by batch) against continuous batching (``ray_ppo.models.continuous.ContinuousBatcher``, and
transformers' own ``generate_batch``), and the same two paths of a vLLM maker, in response tokens
per second.

    python benchmarks/continuous_batching.py [--model smollm2-135m-instruct] [--workload lognormal]
                                             [--prompts 64] [--slots 16] [--rounds 3] [--threads 2]

Workloads:
  lognormal   every answer's length drawn from a lognormal (median ``--median`` tokens, sigma
              ``--sigma``, at most ``--cap``), the same lengths for every engine: ``generate``
              stops a row at its length (an end token forced there, none before), the batcher
              caps each request. It isolates scheduling: a batch runs until its longest row.
  arithmetic  the model's own lengths: arithmetic questions (``ray_ppo.tasks.arithmetic``, level 2),
              half of them asking to show the steps, sampled at temperature 1 up to ``--cap``
              tokens. transformers' ``generate_batch`` runs here too (paged attention on CPU).
  long_tail   the model's own lengths on the long-tail task (``ray_ppo.tasks.long_tail``: short
              two-digit questions and sums or products worked in steps, half each), as
              ``configs/smollm2_long_tail.yaml`` trains it, sampled at temperature 1 up to ``--cap``.

Engines: ``sync`` runs the prompts in batches of ``--slots`` through ``ray_ppo.models.generate``;
``continuous`` keeps ``--slots`` sequences in flight, in order (``schedule="fifo"``);
``longest_first`` does too, starting the longest expected answers first, with each prompt's length
known from a previous epoch (``lognormal`` only: its lengths are fixed per prompt, so the epoch
before gives them exactly, as ``maker.schedule=longest_first`` learns them); ``hf_cb`` is
transformers' ``generate_batch`` with ``--slots`` as its batch budget. ``vllm_sync`` and
``vllm_stream`` (run them in ``.venv-vllm``'s Python) are a vLLM maker's two paths:
``VllmEngine.generate`` on batches of ``--slots`` prompts (``maker.max_running: 0``; vLLM batches
continuously inside a call, but a call ends with its longest answer), and ``VllmBatcher`` keeping
``--slots`` sequences in flight across the whole stream (``maker.max_running``). Rounds are
interleaved (engine order rotates), the figure is the median over rounds with the min-max spread.
"""

from __future__ import annotations

import argparse
import random
import time

import _common  # noqa: F401
from _common import median, publish

PROMPT_LEN = 96
"""Prompt tokens kept (data.max_prompt_len, as configs/smollm2_long_tail.yaml keeps them)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.pretrained (tiny, a packaged model, a path)")
    ap.add_argument("--workload", choices=["lognormal", "arithmetic", "long_tail"], default="lognormal")
    ap.add_argument("--engines", default="sync,continuous,longest_first,hf_cb")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16, help="batch size of sync; sequences in flight otherwise")
    ap.add_argument("--median", type=float, default=16, help="lognormal: median answer length")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal: spread (log scale)")
    ap.add_argument("--cap", type=int, default=128, help="the longest answer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import torch

    from ray_ppo.config import Config
    from ray_ppo.models import load_tokenizer, stop_token_ids
    from ray_ppo.models.build import build_actor, resolve_config, tokenizer_path

    torch.set_num_threads(args.threads)
    cfg = resolve_config(Config().with_overrides({
        "model.pretrained": args.model, "model.dtype": args.dtype, "maker.max_new_tokens": args.cap,
        "maker.temperature": 1.0, "data.max_prompt_len": PROMPT_LEN}))
    actor = build_actor(cfg, with_lora=False).eval()
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    stops = stop_token_ids(tokenizer, actor)
    prompts, lengths = workload(args, tokenizer)
    engines = [e for e in args.engines.split(",") if e != "hf_cb" or args.workload != "lognormal"]
    engines = [e for e in engines if e != "longest_first" or args.workload == "lognormal"]
    engines = [e for e in engines if not e.startswith("vllm") or args.workload != "lognormal"]  # no forced lengths
    runs = {e: [] for e in engines}
    for e in engines:  # models and engines load before the clock starts
        PREPARE.get(e, lambda cfg, dtype: None)(cfg, actor.dtype)
    for r in range(args.rounds):
        for e in engines[r % len(engines):] + engines[:r % len(engines)]:
            torch.manual_seed(r)
            start = time.perf_counter()
            tokens = ENGINES[e](actor, cfg, tokenizer, stops, prompts, lengths, args)
            seconds = time.perf_counter() - start
            runs[e].append((tokens, seconds))
            print(f"round {r + 1} {e}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s", flush=True)
    rows = []
    for e, rs in runs.items():
        rates = [t / s for t, s in rs]
        sync = "vllm_sync" if e.startswith("vllm") else "sync"  # each engine against its own batch path
        base = median([t / s for t, s in runs[sync]]) if sync in runs else None
        rows.append([e, median([t for t, _ in rs]), median(rates), min(rates), max(rates),
                     median(rates) / base if base else None])
    title = (f"{args.model} ({args.dtype}, {args.threads} threads), {args.workload}, {args.prompts} prompts, "
             f"{args.slots} slots, cap {args.cap}, {args.rounds} rounds")
    publish(f"continuous_batching_{args.workload}", ["engine", "tokens", "tokens/s (median)", "min", "max", "x sync"],
            rows, args=args, title=title)


def workload(args, tokenizer) -> tuple[list[list[int]], list[int] | None]:
    """The prompts' token ids and, for ``lognormal``, each answer's length."""
    from ray_ppo.data import PromptEncoder
    from ray_ppo.tasks import long_tail
    from ray_ppo.tasks.arithmetic import make_problems

    chat = bool(getattr(tokenizer, "chat_template", None))  # the tiny model's tokenizer: the questions as text
    if args.workload == "long_tail":
        chats = [p.messages() for p in long_tail.make_problems("train", args.prompts, seed=0)]
        return PromptEncoder(tokenizer, PROMPT_LEN, None).encode(chats if chat else [c[-1]["content"] for c in chats]).ids, None
    rng = random.Random(0)
    problems = make_problems("train", level=2, num=args.prompts, seed=0)
    chats = []
    for i, p in enumerate(problems):
        messages = p.messages()
        if i % 2:  # half of them ask for the working: long answers beside short ones
            messages = [{"role": "user", "content": messages[-1]["content"].replace(
                "Answer with a number.", "Show your steps, then give the answer.")}]
        chats.append(messages)
    if not chat:
        chats = [messages[-1]["content"] for messages in chats]
    ids = PromptEncoder(tokenizer, PROMPT_LEN, None).encode(chats).ids
    if args.workload == "arithmetic":
        return ids, None
    return ids, [max(1, min(args.cap, round(rng.lognormvariate(0, args.sigma) * args.median))) for _ in ids]


def run_sync(actor, cfg, tokenizer, stops, prompts, lengths, args) -> int:
    """``generate`` in batches of ``--slots``; with ``lengths``, each row's end forced at its length."""
    from ray_ppo.models import generate

    total = 0
    for i in range(0, len(prompts), args.slots):
        batch = prompts[i:i + args.slots]
        if lengths is None:
            rollout = generate(actor, batch, cfg.maker, tokenizer.pad_token_id, stops)
        else:
            rollout = _forced_lengths(actor, batch, lengths[i:i + args.slots], cfg, tokenizer)
        total += int(rollout.action_mask.sum())
    return total


def _forced_lengths(actor, batch, lengths, cfg, tokenizer):
    """``generate`` whose row r ends exactly at ``lengths[r]`` tokens (its end token forced there, banned before)."""
    import torch

    from ray_ppo.models import generate

    eos = tokenizer.eos_token_id
    width = max(len(p) for p in batch)
    want = torch.tensor(lengths)

    class Lengths:
        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - width  # tokens generated so far
            ending = (want == made + 1).unsqueeze(1)
            forced = torch.full_like(scores, float("-inf"))
            forced[:, eos] = 0.0
            scores = scores.clone()
            scores[:, eos] = float("-inf")
            return torch.where(ending, forced, scores)

    original = actor.generate

    def patched(*a, logits_processor=None, **kw):
        logits_processor.append(Lengths())
        return original(*a, logits_processor=logits_processor, **kw)

    actor.generate = patched
    try:
        params = cfg.maker.model_copy(update=dict(max_new_tokens=max(lengths)))
        return generate(actor, batch, params, tokenizer.pad_token_id, [eos])
    finally:
        del actor.generate


def run_longest_first(actor, cfg, tokenizer, stops, prompts, lengths, args) -> int:
    return run_continuous(actor, cfg, tokenizer, stops, prompts, lengths, args, schedule="longest_first")


def run_continuous(actor, cfg, tokenizer, stops, prompts, lengths, args, schedule="fifo") -> int:
    from ray_ppo.models.continuous import ContinuousBatcher, Request

    if schedule == "longest_first":
        batcher = ContinuousBatcher(actor, cfg.maker, tokenizer.pad_token_id, [], max_running=args.slots,
                                    schedule=schedule)
        out = batcher.run(Request(i, p, n, expected_len=n) for i, (p, n) in enumerate(zip(prompts, lengths)))
    elif lengths is None:
        batcher = ContinuousBatcher(actor, cfg.maker, tokenizer.pad_token_id, stops, max_running=args.slots)
        out = batcher.run(Request(i, p) for i, p in enumerate(prompts))
    else:  # no end token: each request stops at its length, as the forced rows of sync do
        batcher = ContinuousBatcher(actor, cfg.maker, tokenizer.pad_token_id, [], max_running=args.slots)
        out = batcher.run(Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths)))
    print(f"  {schedule}: {batcher.steps} decode steps, slot utilisation {batcher.utilisation:.2f}")
    return sum(len(f.tokens) for f in out)


_HF_CB = {}


def run_hf_cb(actor, cfg, tokenizer, stops, prompts, lengths, args) -> int:
    """transformers' ``generate_batch``: the model loaded again with paged attention."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.cap, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=list(stops), pad_token_id=tokenizer.pad_token_id)
    out = _HF_CB["model"].generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values())


def _load_hf_cb(cfg, dtype) -> None:
    from transformers import AutoModelForCausalLM

    _HF_CB["model"] = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, dtype=dtype,
                                                           attn_implementation="paged|sdpa").eval()


_VLLM = {}


def _vllm_engine(cfg, streaming: bool):
    """A maker's vLLM engine, built once per path (a streaming maker's runs without vLLM's async
    scheduling, so that a push can land between two of its steps)."""
    from ray_ppo.makers.vllm_engine import build_engine

    if streaming not in _VLLM:
        _VLLM[streaming] = build_engine(cfg.model_copy(update={"maker": cfg.maker.model_copy(
            update={"max_running": 1 if streaming else 0})}), cfg.model.pretrained, seed=0, on_gpu=False)
    return _VLLM[streaming]


def run_vllm_sync(actor, cfg, tokenizer, stops, prompts, lengths, args) -> int:
    """A batch-by-batch vLLM maker: ``VllmEngine.generate`` on ``--slots`` prompts at a time."""
    engine, total = _vllm_engine(cfg, streaming=False), 0
    for i in range(0, len(prompts), args.slots):
        rollout = engine.generate(prompts[i:i + args.slots], cfg.maker, tokenizer.pad_token_id, stops)
        total += int(rollout.action_mask.sum())
    return total


def run_vllm_stream(actor, cfg, tokenizer, stops, prompts, lengths, args) -> int:
    """A streaming vLLM maker: ``VllmBatcher`` with ``--slots`` sequences in flight."""
    from ray_ppo.models.continuous import Request

    engine = _vllm_engine(cfg, streaming=True)
    batcher = engine.continuous_batcher(actor, cfg.maker, tokenizer.pad_token_id, stops, max_running=args.slots)
    batcher.submit(Request(i, p) for i, p in enumerate(prompts))
    out = []
    while batcher.busy:
        out += batcher.step()
    print(f"  vllm_stream: {batcher.steps} engine steps, slot utilisation {batcher.utilisation:.2f}")
    return sum(len(f.tokens) for f in out)


PREPARE = {"hf_cb": _load_hf_cb, "vllm_sync": lambda cfg, dtype: _vllm_engine(cfg, streaming=False),
           "vllm_stream": lambda cfg, dtype: _vllm_engine(cfg, streaming=True)}
"""Each engine's loading, done before the rounds."""

ENGINES = {"sync": run_sync, "continuous": run_continuous, "longest_first": run_longest_first, "hf_cb": run_hf_cb,
           "vllm_sync": run_vllm_sync, "vllm_stream": run_vllm_stream}

if __name__ == "__main__":
    main()

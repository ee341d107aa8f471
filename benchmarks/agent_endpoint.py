"""What the agent endpoint costs: the same calls made straight to a maker's batcher and through the
endpoint with the ``openai`` client, and generation utilisation when agents' tools sleep.

    python benchmarks/agent_endpoint.py [--model smollm2-135m-instruct] [--calls 16] [--slots 1,16]
                                        [--episodes 48] [--sleep-ms 50,200] [--repeats 3]

One maker's engine path as a run has it (``configs/smollm2_calculator_agent.yaml``: SmolLM2-135M-
Instruct as its maker loads it, one torch thread, a greedy ``ContinuousBatcher``, so both sides
generate the same tokens) answers the first ``--calls`` questions of ``data/calculator_eval.jsonl``:

- **overhead**: *direct* submits each question's rendered prompt to the batcher; *endpoint* runs
  one agent per question that makes the same call (the messages and the calculator tool) through
  the maker's endpoint (``ray_ppo.makers.agents``: HTTP on loopback, the chat template, the
  history checks, the reply). overhead = (endpoint s - direct s) / direct s, and per call in ms,
  with ``--slots`` sequences decoding together (1: one call at a time, so nothing hides the
  endpoint's share). Goal (issue 56): at most 10% of generation time.
- **utilisation**: ``--episodes`` agents of 3 calls each, 16 slots; between two calls each agent
  either goes on at once or first runs a "tool" that sleeps a uniformly random time in
  ``--sleep-ms`` (``asyncio.sleep``). utilisation = seconds inside ``batcher.step`` / wall seconds;
  goal: with sleeping tools, at least 0.9 of the utilisation without.

Rounds interleave the two sides, so drift on the machine hits both alike; the tables give the
median and the range over ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from _common import ROOT, median, publish, quick

CONFIG = ROOT / "configs" / "smollm2_calculator_agent.yaml"


def build(model: str):
    import torch

    from ray_ppo.config import load_config
    from ray_ppo.makers.build import build_experience_maker
    from ray_ppo.models.build import resolve_config

    torch.set_num_threads(1)
    cfg = resolve_config(load_config(str(CONFIG)).with_overrides({"model.pretrained": model}))
    return cfg, build_experience_maker(cfg)


def batcher(maker, slots: int):
    """A greedy batcher of ``slots`` that counts the seconds spent in its steps (``busy_s``)."""
    from ray_ppo.models.continuous import ContinuousBatcher

    b = ContinuousBatcher(maker.actor, maker.sampling, maker.tokenizer.pad_token_id, maker.stop_ids,
                          max_running=slots, greedy=True)
    b.busy_s, step = 0.0, b.step

    def timed(admit: bool = True):
        start = time.perf_counter()
        out = step(admit)
        b.busy_s += time.perf_counter() - start
        return out

    b.step = timed
    return b


def run_agents(cfg, maker, fn, questions: list, slots: int):
    """(wall s, the ended episodes, the batcher) of one agent ``fn`` per question, through a maker's
    endpoint and a batcher of ``slots``; every episode must end without a fault."""
    from ray_ppo.makers.agents import AgentRunner

    r = AgentRunner(fn, cfg.agent.model_copy(update={"host": "127.0.0.1"}), cfg.env, maker.tokenizer,
                    max_prompt_len=cfg.data.max_prompt_len)
    stream, b = r.stream(cfg.maker.max_new_tokens), batcher(maker, slots)
    try:
        start = time.perf_counter()
        ended = stream.run(b, [[0]] * len(questions), questions)
        wall = time.perf_counter() - start
    finally:
        r.close()
    assert all(e.fault is None for e in ended), [e.fault for e in ended if e.fault]
    return wall, ended, b


def direct(cfg, maker, questions: list, slots: int) -> tuple[float, int]:
    """(wall s, tokens) of the questions' rendered prompts generated straight by a batcher."""
    from ray_ppo.models.continuous import Request
    from ray_ppo.tools import CALCULATOR

    prompts = [maker.tokenizer(maker.tokenizer.apply_chat_template(q, tools=[CALCULATOR], tokenize=False,
                                                                   add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"] for q in questions]
    b = batcher(maker, slots)
    start = time.perf_counter()
    done = b.run(Request(i, p, max_new_tokens=cfg.maker.max_new_tokens) for i, p in enumerate(prompts))
    return time.perf_counter() - start, sum(len(f.tokens) for f in done)


def through_endpoint(cfg, maker, questions: list, slots: int) -> tuple[float, int]:
    """(wall s, tokens) of the same calls made by agents through the endpoint."""
    from ray_ppo.tools import CALCULATOR

    async def one_call(prompt, endpoint):
        reply = await endpoint.async_client().chat.completions.create(model=endpoint.model, messages=list(prompt),
                                                                      tools=[CALCULATOR])
        return float(len(reply.choices[0].token_ids))

    wall, ended, _ = run_agents(cfg, maker, one_call, questions, slots)
    return wall, int(sum(e.reward for e in ended))


def utilisation(cfg, maker, questions: list, sleep_s: tuple[float, float] | None) -> tuple[float, float]:
    """(utilisation, wall s) of agents making 3 calls each, their tools sleeping ``sleep_s`` (None: not)."""
    async def three_calls(prompt, endpoint):
        client, messages = endpoint.async_client(), list(prompt)
        for _ in range(3):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=16)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
            if sleep_s is not None:
                await asyncio.sleep(random.uniform(*sleep_s))
        return 1.0

    wall, _, b = run_agents(cfg, maker, three_calls, questions, 16)
    return b.busy_s / wall, wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--slots", default="1,16")
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--sleep-ms", default="50,200")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if quick():
        args.model, args.calls, args.slots, args.episodes, args.repeats = "tiny-chat", 4, "2", 8, 1
    random.seed(0)
    cfg, maker = build(args.model)
    rows = [json.loads(line)["prompt"] for line in open(ROOT / "data" / "calculator_eval.jsonl")]
    if args.model == "tiny-chat":  # its tokenizer spells digits only
        rows = [[{"role": "user", "content": " ".join(str(random.randrange(10)) for _ in range(6))}] for _ in rows]
    direct(cfg, maker, rows[:2], 2)  # warm-up: first passes, thread pools, the openai package's import
    through_endpoint(cfg, maker, rows[:2], 2)
    table = []
    for slots in (int(s) for s in args.slots.split(",")):
        base, served, tokens = [], [], set()
        for _ in range(args.repeats):
            wall, made = direct(cfg, maker, rows[:args.calls], slots)
            base.append(wall)
            wall, made_too = through_endpoint(cfg, maker, rows[:args.calls], slots)
            served.append(wall)
            tokens |= {made, made_too}
        overheads = [(s - b) / b for s, b in zip(served, base, strict=True)]
        per_call = [1000 * (s - b) / args.calls for s, b in zip(served, base, strict=True)]
        table.append([slots, args.calls, "/".join(map(str, sorted(tokens))), median(base), median(served),
                      median(overheads), f"{min(overheads):.3f} to {max(overheads):.3f}", median(per_call)])
        print(table[-1], flush=True)
    publish("agent_endpoint", ["slots", "calls", "tokens (direct/endpoint)", "direct s", "endpoint s", "overhead",
                               "overhead range", "ms per call"], table, args,
            title=f"Agent endpoint overhead, {args.model}, greedy, median of {args.repeats} interleaved rounds")
    low, high = (float(x) / 1000 for x in args.sleep_ms.split(","))
    busy, sleeping, walls = [], [], []
    episodes = rows[:args.episodes]
    for _ in range(args.repeats):
        busy.append(utilisation(cfg, maker, episodes, None)[0])
        u, wall = utilisation(cfg, maker, episodes, (low, high))
        sleeping.append(u)
        walls.append(wall)
    ratios = [s / b for s, b in zip(sleeping, busy, strict=True)]
    publish("agent_utilisation", ["episodes", "calls each", "util no sleep", "util sleep", "ratio", "ratio range",
                                  "wall s (sleep)"],
            [[len(episodes), 3, median(busy), median(sleeping), median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}",
              median(walls)]], args,
            title=f"Generation utilisation with agents, {args.model}, 16 slots, tools sleeping {args.sleep_ms} ms, "
                  f"median of {args.repeats} interleaved rounds")


if __name__ == "__main__":
    main()

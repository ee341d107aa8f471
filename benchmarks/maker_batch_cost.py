"""A maker's CPU work per batch outside generation, and per weight swap, measured alone.

    python benchmarks/maker_batch_cost.py [--repeats 50] [--prompts 16] [--response-len 8]

In one process with one torch thread, the steps ``MakerWorker`` takes around each generation
batch in ``overlap_sim.py``'s cells, timed one by one: encoding the prompts (``PromptEncoder``),
the ``ExperienceMaker``'s items (``ray_ppo.makers.testing.WaitingExperienceMaker`` with no wait: the
items of the toy task's shape), tagging them with prompt ids, packing them for the send
(``ExperienceChunk.of``, inline); and the swap of a push into the tiny actor and critic, as
``MakerWorker.weights_end`` does it: prepared while generation goes on (``prepare_swap`` of
staged copies), then applied under the model lock (``PreparedSwap.apply``: what pauses generation).
Medians over ``--repeats``. Compare with the maker shares of ``overlap_sim.py`` (benchmarks/README.md,
"Simulated-device overlap"):
what a step there spends beyond these is contention, not work.
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
from _common import ROOT, median, publish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per batch (overlap_sim: 16)")
    ap.add_argument("--response-len", type=int, default=8)
    args = ap.parse_args()

    import torch

    from ray_ppo.api import resolve_config
    from ray_ppo.config import load_config
    from ray_ppo.data import PromptEncoder
    from ray_ppo.makers.testing import WaitingExperienceMaker
    from ray_ppo.makers.worker import tag_prompt_ids
    from ray_ppo.models.sync import prepare_swap
    from ray_ppo.wire.transport import ExperienceChunk

    torch.set_num_threads(1)
    cfg = resolve_config(load_config(str(ROOT / "configs" / "tiny.yaml")))
    maker = WaitingExperienceMaker(cfg, "m", "cpu", waits=(0.0,), response_len=args.response_len)
    encoder = PromptEncoder(maker.tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template)
    texts = ["3 1 4 1 5"] * args.prompts
    times: dict[str, list[float]] = {k: [] for k in ("encode prompts", "make items", "tag prompt ids",
                                                     "pack for send", "prepare swap, actor", "prepare swap, critic",
                                                     "swap under the lock, actor", "swap under the lock, critic")}

    def timed(name, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        times[name].append(time.perf_counter() - start)
        return out

    for _ in range(args.repeats):
        encoded = timed("encode prompts", encoder.encode, texts)
        items, _stats = timed("make items", maker.make_experience, encoded.ids, 0)
        timed("tag prompt ids", tag_prompt_ids, items, list(range(args.prompts)))
        timed("pack for send", ExperienceChunk.of, items, "inline")
        actor_state = {k: v.clone() for k, v in maker.actor.state_dict().items()}
        critic_state = {k: v.clone() for k, v in maker.critic.state_dict().items()}
        for what, model, state in (("actor", maker.actor, actor_state), ("critic", maker.critic, critic_state)):
            swap = timed(f"prepare swap, {what}", prepare_swap, model, state)
            timed(f"swap under the lock, {what}", swap.apply)

    per_batch = sum(median(times[k]) for k in ("encode prompts", "make items", "tag prompt ids", "pack for send"))
    rows = [[k, median(v) * 1e3] for k, v in times.items()]
    rows += [["per batch (sum of the first four)", per_batch * 1e3],
             *[[f"per swap, {part} (actor + critic)", sum(median(times[f"{part}, {w}"]) for w in ("actor", "critic")) * 1e3]
               for part in ("prepare swap", "swap under the lock")]]
    print(f"\nMaker work outside generation: {args.prompts} prompts per batch, {args.response_len} response tokens, "
          f"one thread, median of {args.repeats}\n")
    publish("maker_batch_cost", ["step", "ms"], rows, args=args)


if __name__ == "__main__":
    main()

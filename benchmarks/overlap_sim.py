"""Simulated-device overlap: the real pipeline with generation and the train step replaced by waits.

    python benchmarks/overlap_sim.py [--repeats 3] [--ratios 1:2,1:1,2:1,4:1] [--makers 1,2,4] [--ranks 1,2]
                                     [--train-s 0.4] [--steps 12] [--skip 4] [--staleness auto|N]
                                     [--prefetch on|off|on,off] [--lengths fixed|lognormal|fixed,lognormal]
                                     [--makers-mode batch,stream,stream_between] [--median 5] [--sigma 1.0] [--cap 64]

Everything is the product's code path (``PPOTrainer.fit``: coordinator, maker actors with their
prompt fetch, admission, send loop and weight swaps, the ``TorchTrainer`` worker group with its
pull, merge, metrics, report and weight pushes of the tiny model), except two things injected
through ``PPOTrainer``'s extension points (no config flag):

- ``experience_maker_factory``: ``ray_ppo.makers.testing.SimulatedDeviceMaker`` holds the real tiny
  actor and critic (they receive the pushes) on a simulated device of ``SLOTS`` (16) sequences
  whose every decode step is a sleep of ``step_s`` with the model lock held, however many slots
  run, as a GPU kernel would hold the device while the CPU is free; it returns items of the toy
  task's shape, as long as the answers drawn;
- ``learner_factory``: ``SimLearner`` is ``PPOLearner`` whose ``train_step`` sleeps ``train_s``.

Answer lengths (``--lengths``): ``fixed``, every answer ``RESPONSE_LEN`` (8) tokens; ``lognormal``,
``round(median * exp(sigma * Z))`` tokens, at least 1, capped at ``--cap`` (``maker.max_new_tokens``),
drawn by each maker with one seed per round (``ray_ppo.makers.testing.AnswerLengths``), so the two
maker modes of a cell in a round answer with the same lengths. Maker modes (``--makers-mode``):
``batch`` (``maker.max_running=0``: a generation batch of 16 sequences runs on the device until its
longest answer ends, the finished slots idle meanwhile) and ``stream`` (``maker.max_running=16``:
the worker drives a ``SimulatedBatcher``, where an answer frees its slot at the step it ends and a
waiting sequence takes it at the next; weights swap in between two decode steps), and
``stream_between`` (the same with ``maker.weight_updates=between_batches``: a push waits until no
sequence runs). All do the same token work per decode step: one token
for each running sequence, up to 16. With fixed lengths the batch mode is the benchmark as it was
before lengths were drawn (a batch is one wait of 8 steps).

T_gen = one maker's time to make one step's samples for all ranks (``train_batch_size x ranks``)
on a device that is always full: the ideal T_gen = tokens of a step's samples x tau / SLOTS,
where tau is the measured duration of one decode step's wait (``step_s`` and whatever the
machine overslept) and the tokens per sample are those the makers made in the measured window.
A slot that idles while a batch's longest answer runs (or while a stream waits for prompts) is
thus pipeline loss, not part of the ideal: with uneven lengths the ideal does not hide the tail.
``T_gen s (measured)`` is what the makers took (their ``generate_s`` per token x tokens of a
step's samples); ``slot utilisation`` = tokens made / (decode steps x SLOTS). ``step_s`` is set
so that the expected ideal T_gen is the cell's T_gen:T_train ratio times ``--train-s``
(the exact mean of the length distribution). T_train = one rank's train step (measured
``train_s``). The synchronous loop would take T_gen + T_train per step; the ideal detached step is
max(T_gen / makers, T_train); ideal speedup = their ratio. Both are taken from the run itself, so
oversleeping on a loaded machine does not count as pipeline loss. ratio / ideal = ideal step /
measured step (steps after the first ``--skip``, from ``elapsed_s``). The decode steps and waits
come from each maker's ``DeviceLog`` (a file; the maker stats Ray carries have no decode steps
for a batch-by-batch maker), read when the window opens and closes.

The ideal assumes every maker generates all the time. The staleness bound decides whether
they may: a batch takes T_gen / b (b = generation batches per step) and the trainer runs a step
every T_gen / makers when generation-bound, so a batch's items are done makers / b versions
after the maker started it; a rank pulls them a step before it trains them (``trainer.prefetch``),
one version more; and the maker may still hold the version before the trainer's when it starts
(a push reaches it after the step that made it), one more. ``--staleness auto`` (the default)
gives each cell ``ppo.max_staleness`` = 2 + ceil(makers / b): the bound under which the makers
never wait at admission while the trainer waits for them. Before 2026-12-02 it was
1 + ceil(makers / b) (1 with one maker), which leaves out the push's lag: the makers then waited
at admission for each push to land, and every step paid its latency (one run of the 1-maker
2-rank 1:1 cell: S=2 0.90 of the ideal, admission share 11%, trainer wait 22 ms per step; S=3
0.96, trainer wait 0.6 ms). With ``--staleness 1`` (the config's default) the makers beyond
S * b batches in flight wait at admission, by design (shown as admission share).

Makers wait for the trainer's first push before they generate (``maker.wait_for_weights``).
Otherwise they fill the buffer up to the staleness bound while the worker group starts, and in a
generation-bound cell the trainer drains that lead inside the measured window, faster than the
makers' pace: with S=3 the 1-maker 1-rank 2:1 and 4:1 cells measured 1.07 and 1.04 of the ideal
(2026-12-02, one round, since aborted).

``--prefetch`` sets ``trainer.prefetch`` (each rank pulls its next step's batch while a step
trains; default on, as in the config); ``on,off`` runs both in every cell, interleaved. So do
comma lists of ``--lengths`` and ``--makers-mode`` (the maker mode varying fastest: a cell's batch
and stream rows sit next to each other); with both modes a second table shows them side by side.
The staleness bound of ``--staleness auto`` is the same in both modes; a streaming maker's items
may be older than a batch's (a long answer spans pushes, counted at its oldest token), which the
``staleness`` column shows; ``token lag`` is the median over measured steps of ``token_lag_mean``,
the trained tokens' own lag (a token sampled after a swap is fresher than its item).

Where the time went, per measured step: trainer ``wait`` (pull: waiting for experience),
``train``, ``push`` (how long rank 0's step was held by the push: a
background thread puts and hands over the buckets, so this is the hand-over), ``other`` (the
rest of the step: gather, starting the metrics all-gather, handing the row to the report thread
(the row is completed and recorded there, off the step's path), and
on the steps due the report to Ray Train; with 2 ranks it includes waiting for the slower rank at
the step's collectives); per maker over the measured window (shares
of makers x window; maker totals from the coordinator when the driver sees the window's first
and last step): ``gen`` busy, ``admission`` (waiting for a prompt batch:
staleness admission), ``back-pressure`` (waiting for the sender / buffer space), ``pause``
(generation held for weight swaps).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import math
import os
import sys
import tempfile
import time

import ray

import _common  # noqa: F401
from _common import init_ray, median, publish, table, tiny_config
from ray_ppo.makers.testing import AnswerLengths, DeviceLog, SimulatedDeviceMaker
from ray_ppo.train.learner import PPOLearner

PROMPTS_PER_BATCH = 16   # maker.batch_size
ITEMS_PER_RANK = 32      # trainer.train_batch_size
RESPONSE_LEN = 8         # --lengths fixed
SLOTS = PROMPTS_PER_BATCH  # sequences the simulated device decodes together (maker.max_running when streaming)
MODES = {"batch": "in_flight", "stream": "in_flight", "stream_between": "between_batches"}
"""``--makers-mode`` -> maker.weight_updates (batch-by-batch makers swap between batches whatever it says)."""


class SimLearner(PPOLearner):
    """``PPOLearner`` (optimizers, state dicts, checkpoints all real) whose update is a wait."""

    train_s = 0.0

    def train_step(self, batch, **kwargs) -> dict[str, float]:
        time.sleep(self.train_s)
        return {"policy_loss": 0.0, "value_loss": 0.0}


class SimLearnerFactory:
    def __init__(self, train_s: float):
        self.train_s = train_s

    def __call__(self, actor, critic, strategy, cfg, seed: int = 0):
        learner = SimLearner(actor, critic, strategy, cfg, seed=seed)
        learner.train_s = self.train_s
        return learner


def cell_config(out: str, makers: int, ranks: int, steps: int, staleness: int, prefetch: bool = True,
                stream: bool = False, cap: int = RESPONSE_LEN, weight_updates: str = "in_flight"):
    return tiny_config(out, {"maker.num_makers": makers, "maker.num_cpus": 0.25, "maker.batch_size": PROMPTS_PER_BATCH,
                             "maker.max_running": SLOTS if stream else 0, "maker.max_new_tokens": cap,
                             "maker.weight_updates": weight_updates,
                             "trainer.num_workers": ranks, "trainer.train_batch_size": ITEMS_PER_RANK,
                             "trainer.mini_batch_size": ITEMS_PER_RANK, "trainer.total_steps": steps,
                             "ppo.max_staleness": staleness, "trainer.prefetch": prefetch,
                             # makers start with the trainer, so no cell starts with a buffer made
                             # while the worker group started (module docstring)
                             "maker.wait_for_weights": True})


def batches_per_step(ranks: int) -> float:
    """Generation batches the trainer consumes per step (b in the module docstring)."""
    return ITEMS_PER_RANK * ranks / PROMPTS_PER_BATCH


def cell_staleness(setting: str, makers: int, ranks: int) -> int:
    """``ppo.max_staleness`` for a cell: ``auto`` = the bound the ideal needs (module docstring)."""
    if setting != "auto":
        return int(setting)
    return 2 + math.ceil(makers / batches_per_step(ranks))


def answer_lengths(kind: str, args) -> tuple[AnswerLengths, int]:
    """The length distribution of ``--lengths`` ``kind`` and its cap (``maker.max_new_tokens``)."""
    if kind == "fixed":
        return AnswerLengths(RESPONSE_LEN), RESPONSE_LEN
    if kind == "lognormal":
        return AnswerLengths(args.median, args.sigma), args.cap
    raise ValueError(f"--lengths {kind!r}: use fixed or lognormal")


def run_cell(makers: int, ranks: int, ratio: float, train_s: float, steps: int, skip: int, staleness: int = 1,
             prefetch: bool = True, lengths: AnswerLengths = AnswerLengths(RESPONSE_LEN), cap: int = RESPONSE_LEN,
             stream: bool = False, seed: int = 0, weight_updates: str = "in_flight") -> dict:
    """One detached run; returns measured T_gen, T_train, step time and the breakdown."""
    from ray_ppo.api import PPOTrainer

    items_per_step = ITEMS_PER_RANK * ranks
    # one maker makes a step's samples in ratio * train_s on a full device, on average
    step_s = ratio * train_s * SLOTS / (items_per_step * lengths.mean(cap))
    snapshots = {}

    def snapshot(metrics: dict) -> None:  # maker totals (and the time) when the measured window opens and closes
        if metrics["step"] in (skip, steps):
            makers = ray.get(trainer.coordinator.status.remote()).makers
            snapshots[metrics["step"]] = (time.perf_counter(), {i: dataclasses.asdict(m) for i, m in makers.items()},
                                          DeviceLog.read(logs))

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as logs:
        maker_factory = functools.partial(SimulatedDeviceMaker, step_s=step_s, lengths=lengths, slots=SLOTS,
                                          log_dir=logs, seed=seed)
        trainer = PPOTrainer(cell_config(out, makers, ranks, steps, staleness, prefetch, stream, cap, weight_updates),
                             experience_maker_factory=maker_factory, learner_factory=SimLearnerFactory(train_s),
                             metrics_callbacks=[snapshot])
        trainer.fit()
    h = sorted(trainer.history, key=lambda m: m["step"])
    kept = h[skip:]
    step_s = (kept[-1]["elapsed_s"] - h[skip - 1]["elapsed_s"]) / len(kept)
    (t0, first, dev0), (t1, last, dev1) = snapshots[skip], snapshots[steps]
    states = [{k: v - first[i][k] for k, v in last[i].items() if isinstance(v, (int, float))} for i in last]
    device = {k: sum(dev1[name][k] - dev0.get(name, {}).get(k, 0) for name in dev1) for k in DeviceLog.FIELDS}
    tau = device["slept_s"] / device["steps"]  # one decode step's measured wait
    tokens_per_item = device["tokens"] / device["sequences"]
    t_gen = items_per_step * tokens_per_item * tau / SLOTS  # the ideal: the device always full
    generate_s, tokens = sum(s["generate_s"] for s in states), sum(s["tokens"] for s in states)
    t_train = median([m["train_s"] for m in kept])
    wall = (t1 - t0) * makers  # maker time between the two snapshots
    steps_s = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(h[skip - 1:], kept)]
    wait = median([m["trainer_idle_ratio"] * s for m, s in zip(kept, steps_s)])
    push = median([m["push_s"] for m in kept])
    return {"t_gen": t_gen, "t_gen_measured": generate_s / tokens * tokens_per_item * items_per_step,
            "utilisation": device["slot_steps"] / (device["steps"] * SLOTS), "tokens_per_item": tokens_per_item,
            "decode_step_s": tau, "t_train": t_train, "step_s": step_s, "median_step_s": median(steps_s), "wait": wait,
            "train": t_train, "push": push,
            "other": median([s - m["trainer_idle_ratio"] * s - m["train_s"] - m["push_s"] for m, s in zip(kept, steps_s)]),
            "gen_share": generate_s / wall,
            "admission": sum(s["admission_s"] for s in states) / wall,
            "backpressure": sum(s["idle_s"] - s["admission_s"] for s in states) / wall,
            "pause": sum(s["pause_s"] for s in states) / wall,
            "staleness": median([m["staleness_mean"] for m in kept]), "max_staleness": staleness,
            "token_lag": median([m["token_lag_mean"] for m in kept]),
            "in_sync": h[-1].get("weights_in_sync")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ratios", default="1:2,1:1,2:1,4:1", help="T_gen:T_train")
    ap.add_argument("--makers", default="1,2,4")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--train-s", type=float, default=0.4, help="T_train: one rank's simulated train step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--staleness", default="auto", help="ppo.max_staleness per cell: auto (what the ideal needs) or a number")
    ap.add_argument("--prefetch", default="on", help="trainer.prefetch: on, off, or on,off (both, interleaved)")
    ap.add_argument("--lengths", default="fixed", help="answer lengths: fixed (8 tokens), lognormal, or fixed,lognormal")
    ap.add_argument("--makers-mode", default="batch",
                    help="batch (maker.max_running=0), stream (maker.max_running=16, weights swapped in flight), "
                         "stream_between (the same, maker.weight_updates=between_batches); a comma list runs them "
                         "interleaved")
    ap.add_argument("--median", type=float, default=5.0, help="--lengths lognormal: the median answer, tokens")
    ap.add_argument("--sigma", type=float, default=1.0, help="--lengths lognormal: standard deviation of the log length")
    ap.add_argument("--cap", type=int, default=64, help="--lengths lognormal: maker.max_new_tokens")
    args = ap.parse_args()
    ratios = {r: (lambda a, b: a / b)(*map(float, r.split(":"))) for r in args.ratios.split(",")}
    # ranks vary fastest, then ratios, then makers: a run cut short still covers both rank counts
    variants = [{"on": True, "off": False}[v] for v in args.prefetch.split(",")]
    kinds = args.lengths.split(",")
    for kind in kinds:
        answer_lengths(kind, args)  # refuses a bad one before anything starts
    modes = args.makers_mode.split(",")
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--makers-mode {args.makers_mode!r}: use a comma list of {', '.join(MODES)}")
    cells = [(ranks, makers, r, p, k, mode) for makers, r, ranks, p, k, mode in
             itertools.product(map(int, args.makers.split(",")), ratios, map(int, args.ranks.split(",")), variants,
                               kinds, modes)]
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # as `ray-ppo train` sets it
    init_ray(num_cpus=16)
    runs = collections.defaultdict(list)
    run_cell(1, 1, 1.0, args.train_s, args.skip + 2, args.skip)  # warm-up: model cache, Ray Train start-up
    started = time.perf_counter()
    for rep in range(args.repeats):  # interleaved: every cell once per round
        for cell in cells:
            ranks, makers, r, prefetch, kind, mode = cell
            lengths, cap = answer_lengths(kind, args)
            res = run_cell(makers, ranks, ratios[r], args.train_s, args.steps, args.skip,
                           cell_staleness(args.staleness, makers, ranks), prefetch, lengths, cap, mode != "batch",
                           seed=rep, weight_updates=MODES[mode])
            runs[cell].append(res)
            print(f"RUN rep={rep} ranks={ranks} makers={makers} ratio={r} prefetch={prefetch} lengths={kind} "
                  f"mode={mode} {res}", file=sys.stderr, flush=True)
        print_table(cells, runs, ratios, args, rep + 1, time.perf_counter() - started)  # usable if cut short


def print_table(cells, runs, ratios, args, rounds: int, elapsed_s: float) -> None:
    rows, ratio_of = [], {}
    for cell in cells:
        ranks, makers, r, prefetch, kind, mode = cell
        rs = runs[cell]
        m = {k: median([x[k] for x in rs]) for k in rs[0] if k != "in_sync"}
        ideal_step = max(m["t_gen"] / makers, m["t_train"])
        ideal_speedup = (m["t_gen"] + m["t_train"]) / ideal_step
        speedup = (m["t_gen"] + m["t_train"]) / m["step_s"]
        ratio_ideal = ideal_step / m["step_s"]
        ratio_of[cell] = (ratio_ideal, m["utilisation"], m["step_s"], m["token_lag"])
        rows.append([ranks, makers, r, "on" if prefetch else "off", kind, mode, int(m["max_staleness"]),
                     m["t_gen"], m["t_gen_measured"], m["t_train"], m["tokens_per_item"], m["decode_step_s"],
                     m["utilisation"], ideal_step, m["step_s"], m["median_step_s"],
                     ideal_speedup, speedup,
                     ratio_ideal, "met" if ratio_ideal >= 0.95 else "missed",
                     m["wait"], m["train"], m["push"], m["other"],
                     m["gen_share"], m["admission"], m["backpressure"], m["pause"], m["staleness"], m["token_lag"],
                     "yes" if all(x["in_sync"] == 1.0 for x in rs) else "NO"])
    lognormal = (f", lognormal answers of median {args.median:g} tokens, sigma {args.sigma:g}, cap {args.cap}"
                 if "lognormal" in args.lengths else "")
    title = (f"Simulated-device overlap: T_train {args.train_s:g} s, {ITEMS_PER_RANK} items per rank per step, "
             f"{PROMPTS_PER_BATCH} prompts per generation batch, {SLOTS} slots{lognormal}, {args.steps} steps of which "
             f"the first {args.skip} excluded, median of {rounds} interleaved rounds ({elapsed_s / 60:.1f} min)")
    # the batch-by-batch grid on fixed lengths keeps its own file (README's headline table reads it)
    name = "overlap_sim" if args.lengths == "fixed" and args.makers_mode == "batch" else "overlap_sim_streaming"
    publish(name, ["ranks", "makers", "T_gen:T_train", "prefetch", "lengths", "makers mode", "max_staleness",
                            "T_gen s", "T_gen s (measured)", "T_train s", "answer tokens (mean)", "decode step s",
                            "slot utilisation", "ideal step s", "step s (mean)", "step s (median)",
                 "ideal speedup", "speedup vs sync", "ratio / ideal", ">= 0.95", "trainer wait s", "train s",
                 "push s", "other s", "maker gen share", "maker admission share", "maker back-pressure share",
                 "maker pause share", "staleness", "token lag", "weights in sync"], rows, args=args, title=title)
    modes = list(dict.fromkeys(cell[-1] for cell in cells))
    if len(modes) > 1:  # the modes of each cell side by side
        pairs = list(dict.fromkeys(cell[:-1] for cell in cells))
        print(f"\nMaker modes side by side (ratio / ideal, slot utilisation, step s, token lag): {', '.join(modes)}\n")
        print(table(["ranks", "makers", "T_gen:T_train", "prefetch", "lengths",
                     *[f"{what} ({mode})" for mode in modes
                       for what in ("ratio / ideal", "slot utilisation", "step s", "token lag")]],
                    [[*pair[:3], "on" if pair[3] else "off", pair[4],
                      *[x for mode in modes for x in ratio_of[(*pair, mode)]]] for pair in pairs]), flush=True)


if __name__ == "__main__":
    main()

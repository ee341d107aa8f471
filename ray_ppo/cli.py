"""The ``ray-ppo`` command line.

    ray-ppo train --config configs/tiny.yaml [--output DIR] [--address ADDR] [key=value ...]
    ray-ppo tune --config configs/tiny.yaml --grid ppo.kl_coef=0.02,0.1 --grid ppo.eps_clip=0.1,0.2
    ray-ppo local --config configs/tiny.yaml [--output DIR] [key=value ...]
    ray-ppo toy-data DIR [--task repeat|sum_mod10|arithmetic|calculator|long_tail]
    ray-ppo eval MODEL --data FILE [--config FILE] [--num-prompts N] [--samples K] [--output FILE.json]
    ray-ppo config [--config FILE] [key=value ...]

``key=value`` overrides may come anywhere on the command line. Bad input (unknown key, bad
value, missing or unreadable file, a model, reward function or prompt file that does not load)
prints one line and exits with status 2, before any Ray process starts. A run that fails after it
started ends with one line too; its full traceback is in RUN_DIR/error.log.
Ctrl-C stops a run within seconds with status 130 and a line saying how to resume it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
import time
import warnings
from pathlib import Path

from ray_ppo.cluster.async_search import FIRST_RUNG
from ray_ppo.config import ConfigError, ConfigWarning, load_config
from ray_ppo.config.preflight import check_run, check_sweep_spec, read_sweep_file
from ray_ppo.data import DataError
from ray_ppo.outputs.evals import eval_summary, read_evals
from ray_ppo.outputs.rundir import RunDirError
from ray_ppo.outputs.tracking import counts_summary, read_metrics
from ray_ppo.train.checkpoint import CheckpointError

EXIT_USAGE = 2


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (configs/tiny.yaml is the CPU demo)")
    parser.add_argument("--output", "-o", help="run directory (default: logging.output_dir, else runs/<name>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. ppo.kl_coef=0.05 trainer.total_steps=20")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-ppo", description="Detached PPO for language models on Ray.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('ray_ppo')}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="detached PPO on a Ray cluster (makers + coordinator + TorchTrainer)",
                           description="Run detached PPO: makers generate while a TorchTrainer trains. Writes "
                                       "DIR/config.yaml, DIR/metrics.jsonl and DIR/checkpoint/.")
    _config_args(train)
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue a stopped run from RUN_DIR/checkpoint (its config.yaml unless --config is "
                            "given; overrides such as trainer.total_steps=200 extend it)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run already in the output directory (it is removed once this run completes a step)")
    train.add_argument("--address", help="attach to a running Ray cluster (e.g. auto or ray://host:10001) "
                                         "instead of starting a local one")
    train.add_argument("--num-cpus", type=int, default=None,
                       help="logical CPUs of the local Ray cluster (default: max(8, cores)); ignored with --address")
    tune = sub.add_parser("tune", help="a Ray Tune sweep of PPO runs (grid over dotted config keys)",
                          description="Sweep config fields with Ray Tune, one detached PPO run per trial. Writes "
                                      "DIR/trials.csv, DIR/sweep.png and DIR/trials/<id>/ per trial.")
    _config_args(tune)
    tune.add_argument("--grid", action="append", default=[], metavar="key=v1,v2,...",
                      help="grid-search values of a config field, e.g. --grid ppo.kl_coef=0.02,0.1 (repeatable)")
    tune.add_argument("--sweep", help="sweep YAML: {grid: {key: [values]}, metric:, mode:, num_samples:}")
    tune.add_argument("--metric", default=None, help="metric to rank trials by (default reward_mean)")
    tune.add_argument("--mode", choices=["max", "min"], default=None, help="maximise or minimise --metric (default max)")
    tune.add_argument("--num-samples", type=int, default=None, help="repeat the grid this many times (default 1)")
    tune.add_argument("--max-concurrent", type=int, default=None,
                      help="trials running at once (default: as many as the cluster's CPUs fit)")
    tune.add_argument("--scheduler", choices=["fifo", "asha"], default="fifo",
                      help="trial scheduler: fifo runs every trial to the end, asha stops weak trials early")
    tune.add_argument("--async-search", type=float, default=None, metavar="BUDGET_S",
                      help="search the pipeline's knobs (maker.num_makers, ppo.max_staleness, trainer.update_steps, "
                           "maker.batch_size, or the --grid keys) for the best reward after BUDGET_S seconds of "
                           "training per trial (ASHA), then rerun the pick and the default to measure the gain")
    tune.add_argument("--confirm-repeats", type=int, default=1,
                      help="with --async-search: runs of each of the pick and the default in the confirmation, "
                           "one per seed from the config's seed on (default 1)")
    tune.add_argument("--first-rung", type=float, default=FIRST_RUNG, metavar="SHARE",
                      help="with --async-search: when ASHA first stops the weaker half of the trials, as a share "
                           "of BUDGET_S (default %(default)g; earlier stops on noise where rewards have not moved yet)")
    tune.add_argument("--address", help="attach to a running Ray cluster instead of starting a local one")
    tune.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray cluster")
    local = sub.add_parser("local", help="the synchronous single-process PPO loop (no Ray)",
                           description="Generate, then train, in one process: the baseline of the benchmarks.")
    _config_args(local)
    local.add_argument("--overwrite", action="store_true", help="replace the run already in the output directory")
    toy = sub.add_parser("toy-data", help="write a built-in task's prompt files")
    toy.add_argument("directory")
    toy.add_argument("--num-prompts", type=int, default=512, help="prompts (arithmetic: training questions)")
    toy.add_argument("--prompt-len", type=int, default=6)
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--task", choices=("repeat", "sum_mod10", "arithmetic", "calculator", "long_tail"), default="repeat",
                     help="repeat: the toy task (repeat the last digit), CSV and Parquet; sum_mod10: the sum of two "
                          "digits mod 10, CSV and Parquet; arithmetic: chat questions for an instruct model, "
                          "train and eval JSON Lines (ray_ppo.tasks.arithmetic); calculator: multiplications to "
                          "answer with a calculator tool, train and eval JSON Lines (ray_ppo.tasks.calculator); long_tail: "
                          "short arithmetic questions mixed with sums and products to work in steps (answers of a "
                          "few to 200+ tokens), train and eval JSON Lines (ray_ppo.tasks.long_tail)")
    toy.add_argument("--level", type=int, choices=(1, 2, 3), default=2,
                     help="arithmetic (and long_tail's short questions): 1 one-digit sums, differences and products, "
                          "2 two-digit sums and differences, 3 two-digit times one-digit")
    toy.add_argument("--num-eval", type=int, default=200, help="arithmetic, calculator, long_tail: held-out questions")
    ev = sub.add_parser("eval", help="evaluate a model, checkpoint or run on a prompt file (no Ray)",
                        description="Generate for a prompt file's prompts and score them with the config's rule "
                                    "reward: accuracy, mean reward and a few samples (ray_ppo.makers.evaluation).")
    ev.add_argument("model", help="a run directory, a checkpoint directory, a model directory or a model name")
    ev.add_argument("--config", "-c", help="YAML config: the reward function, prompt column, sampling settings "
                                           "(default: the run's config.yaml when MODEL is a run or its checkpoint)")
    ev.add_argument("--data", help="prompt file (default: the config's eval.path, else data.path)")
    ev.add_argument("--num-prompts", type=int, default=None,
                    help="the file's first N prompts (default: eval.num_prompts on the run's eval.path, else all)")
    ev.add_argument("--samples", type=int, default=None, metavar="K",
                    help="sample K responses a prompt (mean@K, pass@K) instead of one greedy response")
    ev.add_argument("--output", "-o", metavar="FILE.json", help="also write the result as JSON")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    config = sub.add_parser("config", help="list every config key with its value and what it means",
                            description="Print every config key, its value (the default, or FILE's and the "
                                        "overrides') and its one-line doc.")
    _config_args(config)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides are accepted anywhere, also after options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-")]  # anything else is an override (load_config checks its form)
    if stray or extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    return args


def _current_directory_importable() -> None:
    """``module:function`` settings (reward, environment, tools) name modules of the current
    directory as ``python -m`` finds them; the ``ray-ppo`` script's own path holds only its folder.
    Appended, so a file of the current directory never hides an installed module. Ray gives its
    workers the driver's current directory too."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _current_directory_importable()
    args.run_dir = None  # set by a command once its run directory is known
    _config_warnings_in_one_line(args.command)
    if getattr(args, "address", None):
        _token_auth_if_set_up()  # before anything imports ray: it reads the mode once
    try:
        return {"train": cmd_train, "tune": cmd_tune, "local": cmd_local, "toy-data": cmd_toy_data, "eval": cmd_eval,
                "config": cmd_config}[args.command](args)
    except (ConfigError, DataError, CheckpointError, RunDirError, FileNotFoundError) as e:
        print(f"ray-ppo {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        kept = f"; the trials that ran are in {args.run_dir} (run the command again to search again)" \
            if args.command == "tune" and args.run_dir else ""
        print(f"ray-ppo {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    except Exception as e:  # a failure after the run started: one line, the traceback in RUN_DIR/error.log
        from ray_ppo.outputs.failures import report_failure

        print(f"ray-ppo {args.command}: failed: {report_failure(e, args.run_dir)}", file=sys.stderr)
        return 1


def _config_warnings_in_one_line(command: str) -> None:
    """Print a ``ConfigWarning`` as one line, ``ray-ppo COMMAND: warning: ...``, as errors are
    printed, and each one once (``PPOTrainer.fit`` runs pre-flight again after the command's);
    any other warning as Python prints it."""
    show, shown = warnings.showwarning, set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ConfigWarning):
            show(message, category, filename, lineno, file, line)
        elif str(message) not in shown:
            shown.add(str(message))
            print(f"ray-ppo {command}: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = showwarning


def _load(args):
    if args.command in ("train", "local") and not (args.config or args.overrides or getattr(args, "resume", None)):
        raise ConfigError(f"ray-ppo {args.command} needs a config: give --config FILE (configs/tiny.yaml is the "
                          f"CPU demo) or key=value settings; ray-ppo config lists every key")
    cfg = load_config(args.config, args.overrides)
    if args.output:
        cfg = cfg.with_overrides({"logging.output_dir": args.output})
    return cfg


def _run_outputs(cfg, out_dir: Path, resume_after_step: int | None = None):
    """Per-step callbacks (run files, progress) and a closer that also draws ``curves.png``."""
    from ray_ppo.outputs.writers import run_outputs

    return run_outputs(cfg, out_dir, resume_after_step)


def _summary(history: list[dict], wall_s: float, out_dir: Path) -> str:
    """The run's last line, over the whole run: every step in ``out_dir/metrics.jsonl`` (a resumed
    run's file holds the earlier steps too), and which of them this process trained (``history``,
    in ``wall_s`` seconds) when that is not all of them."""
    if not history:
        return f"no steps completed in {wall_s:.0f} s"
    metrics = out_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else history
    n = max(1, len(rows) // 10)
    first = sum(m["reward_mean"] for m in rows[:n]) / n
    last = sum(m["reward_mean"] for m in rows[-n:]) / n
    samples_per_s = sum(m["samples_per_s"] for m in rows) / len(rows)
    counts = counts_summary(rows)
    steps = f"{len(rows)} steps"
    if len(rows) > len(history):
        steps += f" (steps {history[0]['step']}-{history[-1]['step']} in this process, {len(history)} steps)"
    evals = eval_summary(read_evals(out_dir))
    return (f"done: {steps} in {wall_s:.0f} s | reward {first:.3f} (first 10%) -> {last:.3f} (last 10%) "
            f"| {evals + ' | ' if evals else ''}{samples_per_s:.1f} samples/s | {counts + ' | ' if counts else ''}"
            f"run dir {out_dir}")


def _token_auth_if_set_up() -> None:
    """``ray start --head`` turns on Ray's token authentication and keeps the token in
    ``~/.ray/auth_token``, but a driver attaching to it sends the token only in token mode
    (otherwise: "InvalidAuthToken: Authentication token is missing or incorrect"). Where a token
    is set up, attach in token mode; a cluster without authentication accepts that too. A
    user's own ``RAY_AUTH_MODE`` wins."""
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").exists()):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _init_ray(args, sweep: bool = False, on_give_up=None) -> None:
    """Attach to ``--address``, or start a local cluster (``ray_ppo.cluster.local_cluster``). ``sweep``: the
    local cluster serves Ray's state API (on loopback), which Ray Train's placement-group cleaner
    needs in a sweep. A local start that is interrupted or does not finish within the readiness
    bound calls ``on_give_up`` and ends the process in one line (``ray_ppo.cluster.startup``)."""
    import logging

    import ray

    from ray_ppo.cluster.local_cluster import start_local_cluster

    if args.address:
        # The driver's one Ray Data execution would log its plan and progress every 10 s.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        # As on a local cluster, the workers' logs stay in the cluster's session directory: Ray Train's
        # workers log every reported metrics dict, and its controller its placement decisions.
        # Errors reach the driver as exceptions.
        ray.init(address=args.address, log_to_driver=False)  # in token mode where one is set up (main: _token_auth_if_set_up)
        return
    start_local_cluster(args.num_cpus, sweep=sweep, label=f"ray-ppo {args.command}", on_give_up=on_give_up)


def cmd_train(args) -> int:
    from ray_ppo.outputs.rundir import claim_run_dir, nothing_to_do, resume_point, resuming_line, stopped_line

    resume_from, resume_state = None, None
    if args.resume:
        args.config = args.config or str(Path(args.resume) / "config.yaml")
        args.output = args.output or args.resume
        resume_from, resume_state = resume_point(args.resume)
    cfg = _load(args)
    out_dir = Path(cfg.output_dir).resolve()
    if resume_state and (line := nothing_to_do(args.resume, resume_state.step, cfg.trainer.total_steps)):
        print(line)
        return 0
    check_run(cfg)
    if not args.address:  # the local cluster's CPUs are known before it starts (GPUs: once it has)
        from ray_ppo.cluster.local_cluster import local_cpus
        from ray_ppo.config.resources import ResourcePlan, check_fits

        check_fits(ResourcePlan.of(cfg), {"CPU": local_cpus(args.num_cpus), "GPU": math.inf},
                   where="the local cluster (--num-cpus)")
    claim = claim_run_dir(out_dir, resume=bool(args.resume), overwrite=args.overwrite)
    args.run_dir = out_dir
    if resume_state:
        print(resuming_line(args.resume, resume_state.step, resume_from), flush=True)
    import ray  # after pre-flight: importing Ray and Ray Train takes seconds

    from ray_ppo.api import PPOTrainer

    history: list[dict] = []
    try:
        callbacks, close = _run_outputs(cfg, out_dir, resume_state.step if resume_state else None)
        _init_ray(args, on_give_up=claim.release)
        start = time.perf_counter()
        # Checkpoints reach out_dir/checkpoint as they are written (PPOTrainer.fit publishes them).
        # The coordinator and makers belong to this process (detached=False): a driver killed
        # with SIGKILL on a shared cluster (--address) takes them with it instead of leaving
        # them to hold its CPUs; the run's state is in its checkpoints, for --resume.
        trainer = PPOTrainer(cfg, metrics_callbacks=[claim.started, history.append, *callbacks], resume_from=resume_from,
                             detached=False, preflight=False)  # check_run ran above
        try:
            trainer.fit()
        finally:
            close(trainer.history)
            ray.shutdown()
    except KeyboardInterrupt:
        print(stopped_line("train", out_dir, history[-1]["step"] if history else None), file=sys.stderr)
        return 130
    finally:
        claim.release()
    print(_summary(trainer.history, time.perf_counter() - start, out_dir))
    return 0


def _parse_grid(entries: list[str]) -> dict[str, list]:
    import yaml

    grid = {}
    for entry in entries:
        key, sep, values = entry.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {entry!r} must look like key=v1,v2 (e.g. ppo.kl_coef=0.02,0.1)")
        grid[key.strip()] = [yaml.safe_load(v) for v in values.split(",")]
    return grid


def _sweep_spec(args) -> dict:
    """Grid, metric, mode and samples from --sweep YAML, then --grid/--metric/... on top."""
    spec = read_sweep_file(args.sweep) if args.sweep else {}
    grid = {**(spec.get("grid") or {}), **_parse_grid(args.grid)}
    check_sweep_spec({"grid": grid}, "--grid")
    if not grid:
        raise ConfigError("nothing to sweep: give --grid key=v1,v2 or --sweep FILE")
    return {"grid": grid, "metric": args.metric or spec.get("metric", "reward_mean"),
            "mode": args.mode or spec.get("mode", "max"), "num_samples": args.num_samples or spec.get("num_samples", 1)}


def cmd_tune(args) -> int:
    if args.async_search is not None:
        return cmd_async_search(args)
    cfg = _load(args)
    spec = _sweep_spec(args)
    for key, values in spec["grid"].items():  # unknown keys and bad values fail here, in one line
        for value in values:
            cfg.with_overrides({key: value})
    check_run(cfg)
    out_dir = Path(args.output or f"runs/{cfg.name}-sweep").resolve()
    args.run_dir = out_dir
    import ray  # after pre-flight: importing Ray and Ray Tune takes seconds
    from ray import tune

    from ray_ppo.cluster.sweep import sweep, trial_lines

    scheduler = None
    if args.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="step", max_t=cfg.trainer.total_steps,
                                  grace_period=max(1, cfg.logging.report_every))
    _init_ray(args, sweep=True)
    start = time.perf_counter()
    try:
        outcome = sweep(cfg, {k: tune.grid_search(v) for k, v in spec["grid"].items()}, metric=spec["metric"],
                        mode=spec["mode"], num_samples=spec["num_samples"], scheduler=scheduler,
                        max_concurrent_trials=args.max_concurrent, output_dir=str(out_dir), verbose=0,
                        callbacks=[trial_lines(list(spec["grid"]), spec["metric"], total=math.prod(
                            len(v) for v in spec["grid"].values()) * spec["num_samples"])])
    finally:
        ray.shutdown()
    print(_ranking(outcome.trials, list(spec["grid"]), spec["metric"], spec["mode"]))
    print(f"best: {outcome.best_config} {spec['metric']}={outcome.best_metric:.4f} | checkpoint "
          f"{outcome.best_checkpoint} | {len(outcome.trials)} trials in {time.perf_counter() - start:.0f} s | "
          f"{out_dir / 'trials.csv'}, {out_dir / 'sweep.png'}")
    return 0


def cmd_async_search(args) -> int:
    import ray

    from ray_ppo.cluster.async_search import ASYNC_SPACE, async_search, budgeted, check_first_rung, confirm_seeds

    cfg = _load(args)
    space = _parse_grid(args.grid) or ASYNC_SPACE
    confirm_seeds(cfg, args.confirm_repeats)
    check_first_rung(args.first_rung)
    for key, values in space.items():  # unknown keys and bad values fail here, in one line
        for value in values:
            budgeted(cfg, args.async_search).with_overrides({key: value})
    check_run(cfg)
    out_dir = Path(args.output or f"runs/{cfg.name}-async-search").resolve()
    args.run_dir = out_dir
    _init_ray(args, sweep=True)
    start = time.perf_counter()
    try:
        pick = async_search(cfg, args.async_search, space, num_samples=args.num_samples or 8,
                            repeats=args.confirm_repeats, first_rung=args.first_rung,
                            max_concurrent_trials=args.max_concurrent, output_dir=str(out_dir), progress=sys.stdout)
    finally:
        ray.shutdown()
    print(_ranking(pick.search_trials, list(space), "reward_mean", "max"))
    print(pick.summary())
    print(f"{len(pick.search_trials)} search trials + confirmation in {time.perf_counter() - start:.0f} s | {out_dir}")
    return 0


def _ranking(trials: list[dict], keys: list[str], metric: str, mode: str) -> str:
    def score(t):
        value = t.get(metric)
        return float("-inf") if value is None else (value if mode == "max" else -value)
    header = ["rank", *keys, metric, "status"]
    rows = [[str(i + 1), *(str(t[k]) for k in keys), "-" if t.get(metric) is None else f"{t[metric]:.4f}", t["status"]]
            for i, t in enumerate(sorted(trials, key=score, reverse=True))]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows])


def cmd_local(args) -> int:
    from ray_ppo.local import run_local
    from ray_ppo.outputs.rundir import claim_run_dir

    cfg = _load(args)
    out_dir = Path(cfg.output_dir).resolve()
    check_run(cfg, local=True)
    claim = claim_run_dir(out_dir, overwrite=args.overwrite)
    args.run_dir = out_dir
    try:
        callbacks, close = _run_outputs(cfg, out_dir)
        start = time.perf_counter()
        history: list[dict] = []
        try:
            history = run_local(cfg, on_metrics=lambda m: [callback(m) for callback in [claim.started, *callbacks]])
        finally:
            close(history)
    finally:
        claim.release()
    print(_summary(history, time.perf_counter() - start, out_dir))
    return 0


def cmd_config(args) -> int:
    from ray_ppo.config.reference import describe_config

    print(describe_config(_load(args)))
    return 0


def cmd_eval(args) -> int:
    import json

    from ray_ppo.makers.evaluation import SHOWN_SAMPLES, EvalSetup, evaluate_setup

    if args.num_prompts is not None and args.num_prompts <= 0:
        raise ConfigError(f"--num-prompts must be > 0, got {args.num_prompts}")
    if args.samples is not None and args.samples <= 0:
        raise ConfigError(f"--samples must be > 0, got {args.samples}")
    setup = EvalSetup.of(args.model, args.config, args.overrides, args.data, args.num_prompts, args.samples)
    setup.check()
    print(setup.line(), flush=True)
    result = evaluate_setup(setup)
    for sample in result.samples[:SHOWN_SAMPLES]:
        print(f"  prompt {json.dumps(sample['prompt'])[:120]}\n  response {sample['response']!r} | reward {sample['reward']:g}")
    print(result.line())
    if args.output:
        Path(args.output).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0


def cmd_toy_data(args) -> int:
    from ray_ppo.tasks import arithmetic, calculator, long_tail, sum_mod10, toy

    if args.task == "arithmetic":
        paths = arithmetic.write_problem_files(args.directory, args.level, args.num_prompts, args.num_eval, args.seed)
    elif args.task == "calculator":
        paths = calculator.write_problem_files(args.directory, args.num_prompts, args.num_eval, args.seed)
    elif args.task == "long_tail":
        paths = long_tail.write_problem_files(args.directory, args.num_prompts, args.num_eval, args.seed,
                                              short_level=args.level)
    elif args.task == "sum_mod10":
        paths = sum_mod10.write_prompt_files(args.directory, args.num_prompts, args.seed)
    else:
        paths = toy.write_prompt_files(args.directory, args.num_prompts, args.prompt_len, args.seed)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

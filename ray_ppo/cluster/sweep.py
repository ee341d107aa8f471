"""Ray Tune sweeps over any config fields (``ppo.kl_coef`` and ``ppo.eps_clip`` first of all).

    from ray import tune
    from ray_ppo import load_config
    from ray_ppo.cluster.sweep import sweep

    outcome = sweep(load_config("configs/tiny.yaml"),
                    {"ppo.kl_coef": tune.grid_search([0.02, 0.1]), "ppo.eps_clip": tune.grid_search([0.1, 0.2])},
                    metric="reward_mean", mode="max")
    print(outcome.best_config, outcome.best_metric, outcome.best_checkpoint)

Follows the Ray Train v2 pattern: each trial is a Tune *function* trainable that builds and
fits its own ``PPOTrainer`` (so its own coordinator and makers, in a namespace of their own),
with ``TuneReportCallback`` relaying the trainer's reports to Tune. Search-space keys are the
dotted config names; schedulers (e.g. ASHA) and search algorithms pass straight to
``tune.TuneConfig``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from ray_ppo.cluster.local_cluster import scoped_env
from ray_ppo.config import Config

logger = logging.getLogger(__name__)

TRIAL_DRIVER_CPUS = 0.01
"""CPUs Tune reserves for a trial's driver process, which only waits on its TorchTrainer."""
PRESET_KEY = "preset"
"""A search-space key whose values are whole dicts of dotted overrides (a grid over named settings)."""
CHECKPOINT_PATH_KEY = "checkpoint_path"
"""Key under which ``TuneReportCallback`` puts the path of a trial's reported checkpoint."""


@dataclass
class SweepOutcome:
    """What a sweep returns: the best trial and everything Tune knows."""

    best_config: dict[str, Any]      # the best trial's swept values (dotted keys)
    best_metric: float
    best_checkpoint: str | None      # directory of the best trial's last checkpoint
    best_trial_dir: str              # the best trial's run directory (metrics.jsonl, plots)
    trials: list[dict]               # one row per trial: id, swept values, metric, status, run dir
    result_grid: Any                 # ray.tune.ResultGrid


def trial_plan(cfg: Config, trials: int = 1):
    """What ``trials`` trials running side by side reserve (``ray_ppo.config.resources``)."""
    from ray_ppo.config.resources import ResourcePlan

    return ResourcePlan.of(cfg, trials=trials, trial_cpus=TRIAL_DRIVER_CPUS)


def _trial(tune_config: dict, base: dict, root: str) -> None:
    """The Tune function trainable: one PPO run with the trial's values."""
    from ray import tune
    from ray.train import FailureConfig, RunConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray_ppo.api import PPOTrainer

    trial_id = tune.get_context().get_trial_id()
    cfg = Config.from_dict(base).with_overrides(_overrides(tune_config))
    run_dir = Path(root) / "trials" / trial_id
    cfg = cfg.with_overrides({"name": f"{cfg.name}-{trial_id}", "logging.output_dir": str(run_dir)})
    # Not detached: a trial that Tune stops early (ASHA) ends its process without a clean-up, and
    # its coordinator and makers, owned by that process, go with it.
    # controller_failure_limit: a trial may start while the one ASHA just stopped still holds its
    # CPUs; Ray Train then gives up on the worker group after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S.
    # Two retries of the start ride that out; a request the cluster can never meet still fails,
    # after 3.
    trainer = PPOTrainer(cfg, output_dir=run_dir, detached=False, show_resources=False, run_config=RunConfig(
        name=cfg.name, storage_path=str(run_dir / "ray_train"), callbacks=[TuneReportCallback()],
        failure_config=FailureConfig(max_failures=0, controller_failure_limit=2)))
    trainer.fit()


def sweep(base: Config, param_space: Mapping[str, Any], *, metric: str = "reward_mean", mode: str = "max",
          num_samples: int = 1, scheduler: Any = None, search_alg: Any = None,
          max_concurrent_trials: int | None = None, output_dir: str | None = None, verbose: int = 0,
          callbacks: Sequence[Any] | None = None) -> SweepOutcome:
    """Run a Tune sweep of PPO runs; every key of ``param_space`` is a dotted config name.

    Trials run side by side as far as ``max_concurrent_trials`` allows (default: as many as the
    cluster's CPUs fit, see ``trial_plan``) and queue otherwise; more than the cluster can hold
    side by side is refused (``ray_ppo.config.resources.ResourceError``) unless an autoscaler may add nodes. Random
    sampling (``tune.choice``
    and the like) is seeded by the config's ``seed``, so the same sweep samples the same settings;
    a ``search_alg`` given replaces Tune's generator, and its own seeding. The run's files go to
    ``output_dir`` (default ``runs/<name>-sweep``): ``trials/<id>/`` per trial, plus
    ``trials.csv`` and ``sweep.png``. ``verbose`` and ``callbacks`` pass to ``tune.RunConfig``;
    by default a sweep prints what ``ray-ppo tune`` prints: one line per finished trial
    (``trial_lines``) and nothing of Tune's own (``verbose=0``, with Tune's legacy output engine,
    ``RAY_AIR_NEW_OUTPUT=0``, unless the caller set it: the newer one prints a header and result
    paths even at 0). With no Ray cluster connected, a local one starts, as the CLI's
    (``ray_ppo.cluster.local_cluster``, with the dashboard). Ctrl-C raises ``KeyboardInterrupt``, as in
    ``fit()`` (``ctrl_c_aborts``), rather than returning the trials so far as if the sweep were done.
    """
    import ray
    from ray import tune

    from ray_ppo.api import resolve_config
    from ray_ppo.cluster.local_cluster import start_local_cluster
    from ray_ppo.config.preflight import check_run
    from ray_ppo.config.resources import check_fits, cluster_can_grow
    from ray_ppo.outputs.plots import plot_sweep, write_trials_csv
    from ray_ppo.outputs.tracking import read_metrics

    for key, value in param_space.items():  # fail fast on unknown keys, before any trial starts
        base.with_overrides(_overrides({key: _sample_value(value, {} if key == PRESET_KEY else base.get(key))}))
    check_run(base)  # once, before any trial starts
    base = resolve_config(base)
    if not ray.is_initialized():
        start_local_cluster(sweep=True)
    if callbacks is None:
        callbacks = [trial_lines(list(param_space), metric, total=_grid_size(param_space) * num_samples)]
    root = Path(output_dir or f"runs/{base.name}-sweep").resolve()
    root.mkdir(parents=True, exist_ok=True)
    cluster = ray.cluster_resources()
    if max_concurrent_trials is None:
        max_concurrent_trials = max(1, int(cluster.get("CPU", 1) // max(trial_plan(base).run_cpus, 1)))
    check_fits(trial_plan(base, max_concurrent_trials), cluster, can_grow=cluster_can_grow())
    if search_alg is None:  # Tune's own, seeded: the same command samples the same settings
        from ray.tune.search import BasicVariantGenerator

        # It holds the concurrency limit: Tune ignores TuneConfig's when given a generator.
        search_alg = BasicVariantGenerator(max_concurrent=max_concurrent_trials, random_state=base.seed)
        max_concurrent_trials = None
    if scheduler is not None:
        wait_for_cleaner()
    trainable = tune.with_resources(tune.with_parameters(_trial, base=base.to_dict(), root=str(root)), {"cpu": TRIAL_DRIVER_CPUS})
    tuner = tune.Tuner(
        trainable, param_space=dict(param_space),
        tune_config=tune.TuneConfig(metric=metric, mode=mode, num_samples=num_samples, scheduler=scheduler,
                                    search_alg=search_alg, max_concurrent_trials=max_concurrent_trials),
        run_config=tune.RunConfig(name=f"{base.name}-sweep", storage_path=str(root / "tune"), verbose=verbose,
                                  callbacks=list(callbacks)))
    with ctrl_c_aborts(), scoped_env("RAY_AIR_NEW_OUTPUT", "0", users_wins=True):
        grid = tuner.fit()
    trials = _trial_rows(grid, list(param_space), metric, root)
    write_trials_csv(trials, root / "trials.csv")
    curves = {_label(t, list(param_space)): read_metrics(Path(t["run_dir"]) / "metrics.jsonl")
              for t in trials if (Path(t["run_dir"]) / "metrics.jsonl").exists()}
    plot_sweep(curves, root / "sweep.png", metric=metric)
    best = grid.get_best_result(metric=metric, mode=mode, scope="last")
    best_row = next(t for t in trials if t["trial_id"] == best.metrics["trial_id"])
    return SweepOutcome(
        best_config={k: best.config[k] for k in param_space}, best_metric=best.metrics[metric],
        best_checkpoint=best.metrics.get(CHECKPOINT_PATH_KEY), best_trial_dir=best_row["run_dir"],
        trials=trials, result_grid=grid)


def _grid_size(param_space: Mapping[str, Any]) -> int:
    """Trials of one pass over ``param_space``: the product of its grid searches' lengths."""
    return math.prod(len(v["grid_search"]) for v in param_space.values()
                     if isinstance(v, Mapping) and "grid_search" in v)


@contextlib.contextmanager
def ctrl_c_aborts():
    """Inside: Ctrl-C aborts a Tune run with ``KeyboardInterrupt``, as it aborts ``fit()``.

    Tune's own SIGINT handler ends the run "gracefully" instead: ``Tuner.fit()`` returns the
    trials so far as if the sweep were done, and its caller goes on (an async search would go on to
    confirm a pick from half-run trials). ``TUNE_DISABLE_SIGINT_HANDLER=1`` leaves Python's handler in place;
    the trials, owned by the interrupted driver, end with it (the CLI shuts its cluster down).
    """
    with scoped_env("TUNE_DISABLE_SIGINT_HANDLER", "1"):
        yield


def wait_for_cleaner() -> None:
    """Wait until Ray's state API answers, where the cluster has a dashboard to serve it; warn
    where it has none.

    Tune ends the process of a trial it stops early (ASHA), and the trial's Ray Train controller
    dies with it, without removing its worker group's placement group (which lives as long as the
    sweep's job). Ray Train's placement-group cleaner removes it once it sees the controller dead,
    and it looks through the state API, which a cluster started without the dashboard lacks
    (``tests/ray/test_async_search.py`` checks that stopped trials leave no CPUs reserved)."""
    from ray_ppo.cluster.readiness import dashboard_url, wait_for_state_api

    if dashboard_url():
        wait_for_state_api()
        return
    logger.warning("this Ray cluster runs without the dashboard, so Ray's state API does not answer: a trial that "
                   "the scheduler stops early keeps its Ray Train worker group's CPUs reserved until the sweep "
                   "ends, and later trials may fail with 'worker group startup timed out'. Start the cluster "
                   "with the dashboard (ray.init(include_dashboard=True), or `ray start` as is).")


def trial_lines(keys: Sequence[str], metric: str, stream: TextIO | None = None, total: int | None = None) -> Any:
    """A Tune callback printing one line per trial as it ends, in place of Tune's status tables:

        trial 2/4 done: kl_coef=0.1, eps_clip=0.2 | reward_mean 0.4121 at step 20 | 48 s

    A ``PRESET_KEY`` among ``keys`` shows as the keys it sets.

    ``total``: the number of trials of the sweep; without it, the trials Tune has created so far
    (with ``max_concurrent_trials`` it creates them as slots free up).
    """
    from ray.tune import Callback

    class TrialLines(Callback):
        ended = 0

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._line(trial, total or len(trials), "done")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._line(trial, total or len(trials), "FAILED")

        def _line(self, trial, total: int, status: str) -> None:
            self.ended += 1
            result = trial.last_result or {}
            swept = [item for k in keys for item in
                     ((trial.config.get(k) or {}).items() if k == PRESET_KEY else [(k, trial.config.get(k))])]
            values = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in swept)
            score = result.get(metric)
            shown = f"{metric} {score:.4f} at step {result.get('step')}" if score is not None else "no result"
            print(f"trial {self.ended}/{total} {status}: {values} | {shown} | {result.get('time_total_s', 0):.0f} s",
                  file=stream, flush=True)
    return TrialLines()


def _overrides(tune_config: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's dotted overrides: its swept keys, with a ``PRESET_KEY`` dict expanded in place."""
    out = {k: v for k, v in tune_config.items() if k != PRESET_KEY}
    out.update(tune_config.get(PRESET_KEY) or {})
    return out


def _sample_value(value: Any, default: Any) -> Any:
    """A representative value of a search-space entry, to validate its key and type early."""
    if isinstance(value, dict) and "grid_search" in value:
        return value["grid_search"][0]
    if hasattr(value, "sample"):
        return value.sample()
    return value if not callable(value) else default


def _label(trial: dict, keys: list[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={trial[k]}" for k in keys)


def _trial_rows(grid, keys: list[str], metric: str, root: Path) -> list[dict]:
    rows = []
    for result in grid:
        # Tune adds trial_id to every reported row; a trial that failed before reporting has none.
        trial_id = (result.metrics or {}).get("trial_id") or Path(result.path).name
        row = {"trial_id": trial_id, **{k: result.config.get(k) for k in keys},
               metric: (result.metrics or {}).get(metric), "step": (result.metrics or {}).get("step"),
               "status": "ERROR" if result.error else "TERMINATED",
               "checkpoint": (result.metrics or {}).get(CHECKPOINT_PATH_KEY),
               "run_dir": str(root / "trials" / trial_id), "trial_path": result.path,
               "error": str(result.error).splitlines()[0] if result.error else ""}
        rows.append(row)
    return rows

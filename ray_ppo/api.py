"""``PPOTrainer``: a ``TorchTrainer`` whose ``fit()`` also runs the maker pool and the coordinator.

    trainer = PPOTrainer(load_config("configs/tiny.yaml"))
    result = trainer.fit()          # a normal ray.train.Result, with metrics and a checkpoint

``fit()`` starts the run's coordinator and makers (detached, named actors in a namespace of
their own, so two runs or two Tune trials never collide), trains for ``trainer.total_steps``,
and removes every actor it started, also when the run fails.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ppo.checkpoint import validate_checkpoint
from ray_ppo.config import Config
from ray_ppo.coordinator import Coordinator
from ray_ppo.data import read_prompt_dataset, select_prompt_column
from ray_ppo.makers.actor import maker_actor_class
from ray_ppo.models.tiny import resolve_pretrained
from ray_ppo.tasks.toy import make_prompts
from ray_ppo.train.loop import RunHandles, train_loop_per_worker

ACTOR_READY_TIMEOUT_S = 300.0
"""How long makers may take to load their models before ``fit()`` gives up."""
SHUTDOWN_TIMEOUT_S = 30.0
"""How long makers get to finish their loops after the last step before they are killed."""
POLL_S = 0.5
KILL_WAIT_S = 10.0
"""How long fit() waits for killed actors to disappear from Ray's list of named actors."""
OUTSIDE_CALLER_PLACEMENT_GROUP = "DEFAULT"
"""Scheduling strategy of the makers: never captured by the caller's placement group (a
Tune trial's driver holds one sized for itself alone)."""


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Where the coordinator runs: the node of the process that calls ``fit()``, never elsewhere.

    The coordinator holds the run's buffers, counters and prompt position and is not restarted,
    so it shares its node with the other parts whose loss ends the run anyway: the driver and
    Ray Train's controller (which Ray pins to the driver's node the same way). Left to the
    scheduler it could land on a maker node and die with it, although makers survive that.
    Like the makers it is outside the caller's placement group."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


MetricsCallback = Callable[[dict], None]


def resolve_config(cfg: Config) -> Config:
    """Turn machine-local names into absolute paths before the config travels to other processes:
    ``tiny`` model names to the built model's directory, a relative ``data.path`` to an absolute one."""
    model = dataclasses.replace(
        cfg.model,
        pretrained=resolve_pretrained(cfg.model.pretrained),
        tokenizer=resolve_pretrained(cfg.model.tokenizer),
        critic_pretrained=resolve_pretrained(cfg.model.critic_pretrained),
        reward_pretrained=resolve_pretrained(cfg.model.reward_pretrained),
    )
    data = cfg.data
    if data.path and "://" not in data.path and Path(data.path).exists():
        data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
    return dataclasses.replace(cfg, model=model, data=data)


class PPOTrainer(TorchTrainer):
    """Detached PPO as a Ray Train ``TorchTrainer``.

    Args:
        config: the run's ``Config``.
        prompts: a ``ray.data.Dataset`` of prompts; if None, ``config.data.path`` is read, and
            if that is null too, the toy task's prompts are generated (``config.toy``).
        run_config: Ray Train ``RunConfig``; by default ``storage_path`` is the run's output
            directory and ``controller_failure_limit`` is 0 (no infinite retries).
        metrics_callbacks: called in the driver with each step's metrics, in order.
        scaling_config: overrides the one derived from ``trainer.num_workers`` etc.
        resume_from: a checkpoint directory (``RUN_DIR/checkpoint``) to continue from: weights,
            optimizer, schedulers, KL controller, RNG, step, policy version and prompt position.
            Every trainer worker reads it, so on a multi-node cluster it must be on shared storage.
    """

    def __init__(self, config: Config, prompts: Any = None, *, run_config: RunConfig | None = None,
                 metrics_callbacks: Sequence[MetricsCallback] = (), scaling_config: ScalingConfig | None = None,
                 resume_from: str | Path | None = None, **trainer_kwargs):
        self.ppo_config = resolve_config(config)
        self.resume_state = validate_checkpoint(resume_from) if resume_from else None
        self.namespace = f"ray_ppo.{config.name}.{uuid.uuid4().hex[:8]}"
        self.prompts = prompts
        self.metrics_callbacks = list(metrics_callbacks)
        self.history: list[dict] = []
        t = self.ppo_config.trainer
        worker_resources = {"CPU": t.cpus_per_worker, **({t.node_resource: 1} if t.node_resource else {})}
        scaling_config = scaling_config or ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=worker_resources)
        # A run name of its own: Ray Train v2 resumes any earlier run stored under the same
        # (storage_path, name), and a fresh fit() must not pick up an old run by accident;
        # resuming is explicit (resume_from).
        run_config = run_config or RunConfig(
            name=f"{config.name}-{self.namespace.rsplit('.', 1)[-1]}", storage_path=str(Path(self.ppo_config.output_dir).resolve() / "ray_train"),
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=0))
        super().__init__(
            train_loop_per_worker,
            train_loop_config={"config": self.ppo_config.to_dict(), "handles": dataclasses.asdict(RunHandles(self.namespace)),
                               "resume_from": str(Path(resume_from).resolve()) if resume_from else None},
            scaling_config=scaling_config, run_config=run_config, **trainer_kwargs)
        self.coordinator = None
        self.makers: dict[int, Any] = {}
        self.final_status: dict = {}
        self.maker_summaries: list[dict] = []

    # -- the run ---------------------------------------------------------------------------------
    def fit(self):
        """Start coordinator and makers, train, stop them; returns the ``ray.train.Result``."""
        self._start_actors()
        poller = _MetricsPoller(self.coordinator, self._on_metrics, self._watch_makers)
        poller.start()
        try:
            result = super().fit()
            poller.stop()
            self._finish_actors()
        finally:
            poller.stop()
            self._kill_actors()
        if not result.metrics and self.history:
            result.metrics = dict(self.history[-1])
        return result

    def _watch_makers(self) -> None:
        """A maker loop that ended with an error (a dead maker out of restarts, or a raised
        exception) is reported to the coordinator, whose next pull ends the run with it."""
        done, _ = ray.wait(list(self._loops), num_returns=len(self._loops), timeout=0)
        for ref in done:
            maker_id = self._loops.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.coordinator.maker_failed.remote(maker_id, f"maker_{maker_id} died and was not restarted "
                                                               f"(maker.max_restarts={self.ppo_config.maker.max_restarts}): "
                                                               f"{str(e).splitlines()[0]}")
            except ray.exceptions.RayTaskError:
                pass  # the maker reported its own exception to the coordinator
            else:
                self._finished_loops.append(ref)

    def _on_metrics(self, metrics: dict) -> None:
        self.history.append(metrics)
        for callback in self.metrics_callbacks:
            callback(metrics)

    def _dataset(self):
        d = self.ppo_config.data
        if self.prompts is not None:
            return select_prompt_column(self.prompts, d.prompt_column)
        if not d.path:
            toy = self.ppo_config.toy
            texts = make_prompts(toy.num_prompts, toy.prompt_len, toy.seed)
            return ray.data.from_items([{"prompt": t} for t in texts])
        return read_prompt_dataset(d.path, d.prompt_column, d.format)

    def _start_actors(self) -> None:
        cfg = self.ppo_config
        dataset = self._dataset()
        self.coordinator = ray.remote(num_cpus=0)(Coordinator).options(
            name="coordinator", namespace=self.namespace, lifetime="detached",
            scheduling_strategy=on_driver_node()).remote(
            num_ranks=cfg.trainer.num_workers, num_makers=cfg.maker.num_makers, buffer_size=cfg.buffer_size,
            max_staleness=cfg.ppo.max_staleness, routing=cfg.topology.routing, prompts=dataset,
            items_per_version=cfg.trainer.update_steps * cfg.trainer.train_batch_size * cfg.trainer.num_workers,
            prompt_batch_size=cfg.maker.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed,
            initial_version=self.resume_state["policy_version"] if self.resume_state else 0,
            data_start=self.resume_state.get("data") if self.resume_state else None,
            samples_per_prompt=cfg.maker.samples_per_prompt)
        maker_cls = maker_actor_class(cfg.maker.num_cpus, cfg.maker.num_gpus, cfg.maker.max_restarts,
                                      {cfg.maker.node_resource: 1} if cfg.maker.node_resource else None)
        self.makers = {
            i: maker_cls.options(name=f"maker_{i}", namespace=self.namespace, lifetime="detached",
                                 scheduling_strategy=OUTSIDE_CALLER_PLACEMENT_GROUP).remote(
                i, cfg.to_dict(), self.coordinator)
            for i in range(cfg.maker.num_makers)}
        try:
            ray.get(self.coordinator.register_makers.remote(self.makers), timeout=ACTOR_READY_TIMEOUT_S)
            ray.get([m.ping.remote() for m in self.makers.values()], timeout=ACTOR_READY_TIMEOUT_S)
        except Exception:
            self._kill_actors()
            raise
        self._finished_loops: list = []
        self._loops = {m.run.remote(): i for i, m in self.makers.items()}
        self._loops.update({m.send_loop.remote(): i for i, m in self.makers.items()})

    def _finish_actors(self) -> None:
        """Tell the coordinator the run is over, let makers drain, keep their summaries."""
        self.final_status = ray.get(self.coordinator.finish.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        ready, _ = ray.wait(list(self._loops), num_returns=len(self._loops), timeout=SHUTDOWN_TIMEOUT_S)
        self.maker_summaries = [ray.get(r) for r in [*self._finished_loops, *ready]]
        self.final_status = ray.get(self.coordinator.status.remote(), timeout=SHUTDOWN_TIMEOUT_S)

    def _kill_actors(self) -> None:
        """Kill the run's detached actors and wait (briefly) until Ray no longer lists them."""
        for handle in [*self.makers.values(), self.coordinator]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self.makers, self.coordinator = {}, None
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and any(
                a["namespace"] == self.namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            time.sleep(0.1)


class _MetricsPoller:
    """Driver thread relaying per-step metrics from the coordinator to callbacks, in order."""

    def __init__(self, coordinator: Any, callback: MetricsCallback, watch: Callable[[], None]):
        self.coordinator, self.callback, self.watch = coordinator, callback, watch
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray_ppo-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=10)
            self._drain()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._drain()
            self.watch()

    def _drain(self) -> None:
        try:
            new = ray.get(self.coordinator.metrics_since.remote(self.seen), timeout=10)
        except Exception:  # the coordinator is gone (run over or failed): nothing more to relay
            return
        for metrics in new:
            self.seen += 1
            self.callback(metrics)

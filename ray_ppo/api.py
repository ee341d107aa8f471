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
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ppo.cluster.datasets import read_prompt_dataset
from ray_ppo.cluster.handles import CoordinatorClient
from ray_ppo.cluster.local_cluster import start_local_cluster
from ray_ppo.config import Config
from ray_ppo.config.preflight import check_run
from ray_ppo.config.resources import ResourcePlan, check_fits, cluster_can_grow, worker_resources
from ray_ppo.coordinator.actor import CoordinatorActor
from ray_ppo.makers.worker import maker_actor_class
from ray_ppo.models.build import resolve_config
from ray_ppo.outputs.evals import split_evals
from ray_ppo.outputs.rundir import CheckpointPublisher
from ray_ppo.outputs.samples import split_samples
from ray_ppo.tasks.toy import make_prompts
from ray_ppo.train.checkpoint import validate_checkpoint
from ray_ppo.train.loop import train_loop_per_worker
from ray_ppo.wire.messages import CoordinatorStatus, RunHandles

ACTOR_READY_TIMEOUT_S = 300.0
"""How long ``fit()`` waits for the coordinator to register vLLM makers (only they are awaited
before training starts) before it gives up."""
VLLM_READY_TIMEOUT_S = 1200.0
"""How long vLLM makers (maker.engine=vllm) may take to come up (import vLLM, start an engine) before
``fit()`` gives up: seconds on a quiet machine, minutes on a CPU machine shared with other jobs."""
SHUTDOWN_TIMEOUT_S = 30.0
"""How long makers get to finish their loops after the last step before they are killed."""
POLL_S = 0.5
ABORT_WAIT_S = 2.0
"""How long fit() waits for Ray Train's controller to acknowledge an abort (Ctrl-C)."""
KILL_WAIT_S = 10.0
"""How long fit() waits for a killed actor to be dead (the coordinator: before the makers are
killed), and for the run's killed actors to disappear from Ray's list of named actors."""
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


def _wait_until_dead(handle: Any, timeout_s: float) -> None:
    """Wait until Ray has the killed actor of ``handle`` dead (a call to it fails), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=left_s)  # answers until the kill has landed
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.1)


MetricsCallback = Callable[[dict], None]


class PPOTrainer(TorchTrainer):
    """Detached PPO as a Ray Train ``TorchTrainer``.

    Args:
        config: the run's ``Config``.
        prompts: a ``ray.data.Dataset`` of prompts; if None, ``config.data.path`` is read, and
            if that is null too, the toy task's prompts are generated (``config.toy``).
        run_config: Ray Train ``RunConfig``; by default ``storage_path`` is ``ray_train`` in
            ``output_dir`` if given, else in ``logging.output_dir`` (the result's checkpoint lies
            there), and ``controller_failure_limit`` is 0 (no infinite retries).
        metrics_callbacks: called in the driver with each step's metrics, in order.
        scaling_config: overrides the one derived from ``trainer.num_workers`` etc.
        resume_from: a checkpoint directory (``RUN_DIR/checkpoint``) to continue from: weights,
            optimizer, schedulers, KL controller, RNG, step, policy version and prompt position.
            Every trainer worker reads it, so on a multi-node cluster it must be on shared storage.
        output_dir: if given, ``fit()`` writes the run files the CLI writes there (``config.yaml``,
            ``metrics.jsonl``, ``samples.jsonl``, TensorBoard events, ``curves.png``; ``ray_ppo.outputs.writers``).
        experience_maker_factory: builds each maker's ``ExperienceMaker`` as
            ``factory(cfg, name=, device=)`` (default ``build.build_experience_maker``).
        learner_factory: builds each trainer rank's learner as ``factory(policy, critic, strategy,
            params, seed=)`` (default ``PPOLearner``). Both are extension points for simulations
            and benchmarks (``benchmarks/overlap_sim.py``; ``ray_ppo.makers.testing.WaitingExperienceMaker``
            is a maker whose rollout is a wait): they must be picklable.
        detached: True (default): the coordinator and makers are detached actors, independent of
            the calling process; ``fit()`` removes them itself when the run ends, fails or is
            interrupted. False: they are owned by the process that calls ``fit()``, and Ray also
            removes them when that process dies without a clean-up (a Tune trial that ASHA stops:
            ``ray_ppo.cluster.sweep`` runs its trials so).
        show_resources: print the run's resource plan when ``fit()`` starts (``ray_ppo.config.resources``;
            a sweep prints none per trial). A plan the cluster cannot hold is refused either way
            (``ResourceError``), unless the cluster may grow (one this process did not start).
        preflight: True (default): ``fit()`` first runs ``ray_ppo.config.preflight.check_run`` on the
            config and prompts (one-line errors, before any actor starts). False: the caller has
            run it on this config (the CLI does, before it imports Ray).
    """

    def __init__(self, config: Config, prompts: Any = None, *, run_config: RunConfig | None = None,
                 metrics_callbacks: Sequence[MetricsCallback] = (), scaling_config: ScalingConfig | None = None,
                 resume_from: str | Path | None = None, output_dir: str | Path | None = None,
                 experience_maker_factory: Callable | None = None, learner_factory: Callable | None = None,
                 detached: bool = True, show_resources: bool = True, preflight: bool = True, **trainer_kwargs):
        self.ppo_config = resolve_config(config)
        self.output_dir = Path(output_dir).resolve() if output_dir is not None else None
        self.resume_state = validate_checkpoint(resume_from) if resume_from else None
        self.namespace = f"ray_ppo.{config.name}.{uuid.uuid4().hex[:8]}"
        self.handles = RunHandles(self.namespace)  # one name for the coordinator it is created with and looked up by
        self.prompts = prompts
        self.metrics_callbacks = list(metrics_callbacks)
        self.experience_maker_factory = experience_maker_factory
        self.lifetime = "detached" if detached else None
        self.show_resources = show_resources
        self.preflight = preflight
        self.history: list[dict] = []
        t = self.ppo_config.trainer
        scaling_config = scaling_config or ScalingConfig(
            num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=worker_resources(t))
        # A run name of its own: Ray Train v2 resumes any earlier run stored under the same
        # (storage_path, name), and a fresh fit() must not pick up an old run by accident;
        # resuming is explicit (resume_from).
        run_dir = self.output_dir or Path(self.ppo_config.output_dir).resolve()
        run_config = run_config or RunConfig(
            name=f"{config.name}-{self.namespace.rsplit('.', 1)[-1]}", storage_path=str(run_dir / "ray_train"),
            failure_config=FailureConfig(max_failures=t.max_failures, controller_failure_limit=0),
            # Ray keeps one more than RUN_DIR needs at 1, so the newest is never deleted
            # before the driver has published it.
            checkpoint_config=CheckpointConfig(num_to_keep=max(t.keep_checkpoints, 2)))
        super().__init__(
            train_loop_per_worker,
            train_loop_config={"config": self.ppo_config.to_dict(), "handles": dataclasses.asdict(self.handles),
                               "resume_from": str(Path(resume_from).resolve()) if resume_from else None,
                               "learner_factory": learner_factory},
            scaling_config=scaling_config, run_config=run_config, **trainer_kwargs)
        self.coordinator = None
        self.makers: dict[int, Any] = {}
        self._loops: _MakerLoops | None = None
        self.final_status: CoordinatorStatus | None = None  # the coordinator's status at the end of fit()
        self.maker_summaries: list[dict] = []
        self.interrupted = False
        self._controller = None

    # -- the run ---------------------------------------------------------------------------------
    def fit(self):
        """Start coordinator and makers, train, stop them; returns the ``ray.train.Result``.

        Each checkpoint is published to ``output_dir/checkpoint`` as soon as Ray Train stored it.
        Ctrl-C (``KeyboardInterrupt``) aborts the run within seconds, sets ``interrupted``, and
        is re-raised once the run's actors are gone."""
        if self.preflight:
            check_run(self.ppo_config, self.prompts)  # before any actor starts: one-line errors
        self._check_resources()
        close_outputs = self._open_outputs()
        try:
            self._start_actors()
        except BaseException:
            self._kill_actors()
            close_outputs(self.history)
            raise
        run_dir = self.output_dir or Path(self.ppo_config.output_dir).resolve()
        publisher = CheckpointPublisher(CoordinatorClient(self.coordinator), run_dir, self.ppo_config.trainer.keep_checkpoints)
        poller = _MetricsPoller(self.coordinator, self._on_metrics, publisher.poll)
        poller.start()
        self._loops.watch()
        try:
            result = super().fit()
            poller.stop()
            self._loops.stop()
            self._finish_actors()
        except KeyboardInterrupt:
            self.interrupted = True
            self._abort_controller()
            raise
        finally:
            poller.stop()
            publisher.poll()  # what was stored before the run ended, also when it failed
            self._kill_actors()
            close_outputs(self.history)
        if not result.metrics and self.history:
            result.metrics = dict(self.history[-1])
        if result.checkpoint is not None and "step" in result.metrics:  # in case no rank announced it
            publisher.publish(int(result.metrics["step"]), result.checkpoint)
        return result

    def _check_resources(self) -> None:
        """Refuse a run the cluster cannot hold, in one line (``ray_ppo.config.resources``), and print
        the plan. With no cluster connected, a local one starts (``ray_ppo.cluster.local_cluster``)."""
        if not ray.is_initialized():
            start_local_cluster()
        plan = ResourcePlan.of(self.ppo_config, given_dataset=self.prompts is not None)
        cluster, can_grow = ray.cluster_resources(), cluster_can_grow()
        check_fits(plan, cluster, can_grow=can_grow)
        if self.show_resources:
            pending = "; the rest stays pending until the cluster adds nodes" if plan.cpus > cluster.get("CPU", 0) else ""
            print(plan.line(cluster) + pending, flush=True)

    def _register_sigint_handler(self, controller) -> None:
        """Ray Train's own handler swallows Ctrl-C (it aborts the run and later exits with status
        0 or 1, without a word). Keep Python's: ``fit()`` sees a ``KeyboardInterrupt`` and aborts.
        The one override of a Ray-private method in the package; ``tests/unit/test_ray_adapter.py``
        fails if a Ray upgrade renames it or stops calling it."""
        self._controller = controller

    def _abort_controller(self) -> None:
        """Ask Ray Train's controller to stop the worker group; wait briefly (it goes on in the
        background, and a ``ray.shutdown()`` ends it anyway)."""
        if self._controller is not None:
            try:
                ray.wait([self._controller.abort.remote()], timeout=ABORT_WAIT_S)
            except Exception:  # already gone
                pass

    def _open_outputs(self) -> Callable[[list[dict]], None]:
        """With ``output_dir``: add the run-file writers to the callbacks; returns their closer."""
        if self.output_dir is None:
            return lambda history: None
        from ray_ppo.outputs.writers import run_outputs

        callbacks, close = run_outputs(self.ppo_config, self.output_dir,
                                       self.resume_state.step if self.resume_state else None, progress=False)
        self.metrics_callbacks += callbacks
        return close

    def _on_metrics(self, metrics: dict) -> None:
        self.history.append(split_evals(split_samples(metrics)[0])[0])
        for callback in self.metrics_callbacks:
            callback(metrics)

    def _dataset(self) -> tuple[Any, str]:
        """The prompt dataset and the column that holds the prompts (a given dataset's column is
        checked by pre-flight, ``check_run``)."""
        d = self.ppo_config.data
        if self.prompts is not None:
            return self.prompts, d.prompt_column
        if not d.path:
            toy = self.ppo_config.toy
            texts = make_prompts(toy.num_prompts, toy.prompt_len, toy.seed)
            return ray.data.from_items([{"prompt": t} for t in texts]), "prompt"
        return read_prompt_dataset(d.path, d.prompt_column, d.format, checked=True), d.prompt_column  # check_run read it

    def _start_actors(self) -> None:
        cfg = self.ppo_config
        dataset, prompt_column = self._dataset()
        self.coordinator = ray.remote(num_cpus=0)(CoordinatorActor).options(
            name=self.handles.coordinator_name, namespace=self.namespace, lifetime=self.lifetime,
            scheduling_strategy=on_driver_node()).remote(
            cfg, prompts=dataset, prompt_column=prompt_column,
            initial_version=self.resume_state.policy_version if self.resume_state else 0,
            data_start=self.resume_state.data if self.resume_state else None)
        maker_cls = maker_actor_class(cfg.maker.num_cpus, cfg.maker.num_gpus, cfg.maker.max_restarts,
                                      {cfg.maker.node_resource: 1} if cfg.maker.node_resource else None)
        self.makers = {
            i: maker_cls.options(name=f"maker_{i}", namespace=self.namespace, lifetime=self.lifetime,
                                 scheduling_strategy=OUTSIDE_CALLER_PLACEMENT_GROUP).remote(
                i, cfg.to_dict(), self.handles, self.experience_maker_factory)  # not the handle: see RunHandles
            for i in range(cfg.maker.num_makers)}
        self._loops = _MakerLoops(self.coordinator, self.makers, self.coordinator.register_makers.remote(self.makers),
                                  cfg.maker.max_restarts)
        if cfg.maker.engine == "vllm":  # minutes on a loaded CPU machine: longer than a pull may wait
            try:
                ray.get(self._loops.registered, timeout=ACTOR_READY_TIMEOUT_S)
                ray.get([m.ping.remote() for m in self.makers.values()], timeout=VLLM_READY_TIMEOUT_S)
            except Exception:
                self._kill_actors()
                raise
            self._loops.start()
        # Otherwise nothing is awaited: the coordinator and the makers start while Ray Train starts
        # the worker group (start-up overlaps), and the makers' loops start from a driver thread of
        # their own as soon as the coordinator has registered the makers (_MakerLoops.watch). A
        # coordinator that fails to start ends the run at the trainer's first pull; a maker that
        # fails to start ends its loops with the error, which that thread reports to the
        # coordinator, whose next pull ends the run with it.

    def _finish_actors(self) -> None:
        """Tell the coordinator the run is over, let makers drain, keep their summaries."""
        self.final_status = ray.get(self.coordinator.finish.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        self.maker_summaries = self._loops.summaries(SHUTDOWN_TIMEOUT_S)
        self.final_status = ray.get(self.coordinator.status.remote(), timeout=SHUTDOWN_TIMEOUT_S)

    def _kill_actors(self) -> None:
        """Kill the run's actors and wait (briefly) until Ray no longer lists them, without a word
        on the terminal. Ray retries a call that was under way on a maker it kills (makers may
        restart) and prints a line for each, so nothing calls a maker by then: the driver's loop
        calls are cancelled (``_MakerLoops.drop``), and the coordinator, which relays weight pushes to
        the makers, is dead before they are killed."""
        if self._loops is not None:
            self._loops.drop()
        if self.coordinator is not None:
            ray.kill(self.coordinator, no_restart=True)
            _wait_until_dead(self.coordinator, KILL_WAIT_S)
        for handle in self.makers.values():
            ray.kill(handle, no_restart=True)
        self.makers, self.coordinator = {}, None
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and any(
                a["namespace"] == self.namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            time.sleep(0.1)


class _MakerLoops:
    """The makers' generation and send loops, each a call the driver holds. Started once the
    coordinator has registered the makers (``start``, or ``watch`` from a driver thread of their
    own); a loop that ends with an error is reported to the coordinator by that thread, and the
    coordinator's next pull ends the run with it. Once the thread is stopped, the driver collects
    the makers' summaries (``summaries``) or lets the loops go (``drop``)."""

    def __init__(self, coordinator: Any, makers: dict[int, Any], registered: ray.ObjectRef, max_restarts: int):
        self.coordinator, self.makers, self.max_restarts = coordinator, makers, max_restarts
        self.registered = registered  # the coordinator's acknowledgement of the makers
        self.running: dict[ray.ObjectRef, tuple[int, str]] = {}  # each loop's call -> its maker and loop
        self.finished: list[ray.ObjectRef] = []  # loops that returned their summary
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ray_ppo-makers", daemon=True)

    def start(self) -> None:
        """Start each maker's generation and send loops."""
        self.running = {m.run.remote(): (i, "run") for i, m in self.makers.items()}
        self.running.update({m.send_loop.remote(): (i, "send_loop") for i, m in self.makers.items()})

    def watch(self) -> None:
        """Start the thread that starts the loops (unless started) and watches them."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; the driver owns the loops from here."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        if not self.running:
            while not ray.wait([self.registered], timeout=POLL_S)[0]:
                if self._stop.is_set():
                    return
            try:
                ray.get(self.registered)
            except Exception:  # the coordinator failed to start: the trainer's first pull says why
                return
            if self._stop.is_set():
                return
            self.start()
        while not self._stop.wait(POLL_S):
            self._check()

    def _check(self) -> None:
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        for ref in done:
            maker_id, loop = self.running.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.coordinator.maker_failed.remote(maker_id, f"maker_{maker_id} died and was not restarted "
                                                               f"(maker.max_restarts={self.max_restarts}): "
                                                               f"{str(e).splitlines()[0]}")
            except ray.exceptions.RayTaskError as e:
                # The maker reports its own exception first, and the coordinator keeps a maker's
                # first failure; this one is for an error raised before the loop's own handler ran.
                # ray.get raises the error as an instance of its cause's class too, which forwards
                # attributes it lacks (function_name, traceback_str) to the cause: the loop's name
                # comes from the call, the traceback from the error's text.
                first_line = (str(e.cause).splitlines() or [""])[0]
                self.coordinator.maker_failed.remote(
                    maker_id, f"maker_{maker_id}'s {loop} raised {type(e.cause).__name__}: {first_line}", str(e))
            else:
                self.finished.append(ref)

    def summaries(self, timeout_s: float) -> list[dict]:
        """Each loop's summary, once the loops still running have ended (at most ``timeout_s``)."""
        ready, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout_s)
        return [ray.get(ref) for ref in [*self.finished, *ready]]

    def drop(self) -> None:
        """Forget the loops' calls. One still under way is cancelled (Ray does not retry a
        cancelled call when its maker is killed). One that ended with an error is retrieved and
        let go, as Ray prints an error that nobody retrieved: the thread or the maker itself
        reported it to the coordinator, whose next pull ends the run with it."""
        self.stop()
        done, running = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        for ref in running:
            ray.cancel(ref, recursive=False)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass
        self.running = {}


class _MetricsPoller:
    """Driver thread relaying per-step metrics from the coordinator to callbacks, in order (and
    calling ``watch`` after each poll: the checkpoint publisher's)."""

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

"""``train_loop_per_worker`` for the detached PPO ``TorchTrainer``: the loop and nothing else.

Each step reads top to bottom: pull -> train -> publish -> checkpoint -> report. The parts live
with their kind: the weight publisher in ``ray_ppo.train.publish``, the checkpoint writer in
``ray_ppo.train.checkpoint``, the statistics in ``ray_ppo.algo.metrics`` and ``ray_ppo.train.monitor``, and the
step's collectives, named for what they synchronise, in ``ray_ppo.train.collectives``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import ray
import ray.train
import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem, KLController, make_kl_controller
from ray_ppo.algo.metrics import experience_metrics
from ray_ppo.cluster.handles import CoordinatorClient, fetch_objects, find_coordinator
from ray_ppo.config import Config, TrainerConfig
from ray_ppo.data.seeds import rank_seed
from ray_ppo.models import load_tokenizer
from ray_ppo.models.build import build_actor, build_critic_if_needed, tokenizer_path
from ray_ppo.models.sync import as_held, fingerprint
from ray_ppo.outputs.evals import attach_evals, split_evals
from ray_ppo.outputs.samples import SAMPLES_KEY, step_samples
from ray_ppo.train.checkpoint import CheckpointWriter, RunState, TrainerState, restore_point, restored_critic
from ray_ppo.train.collectives import all_reduce_metrics, broadcast_from_rank_0, broadcast_time_up, start_all_reduce_metrics
from ray_ppo.train.learner import PPOLearner, drop_absent
from ray_ppo.train.monitor import MakerMonitor, verify_makers
from ray_ppo.train.publish import WeightPublisher
from ray_ppo.train.strategies import make_strategy
from ray_ppo.wire.messages import ItemsLost, PullRequest, RunHandles
from ray_ppo.wire.transport import ExperienceChunk, Fetched, resolve


@dataclass(frozen=True)
class _Run:
    """What one rank holds for the whole run, fixed once the rank has started. The objects it names
    keep their own state: the learner its weights, the KL controller its coefficient, each thread
    its last call."""

    cfg: Config
    rank: int
    world: int
    device: torch.device
    coordinator: Any
    learner: PPOLearner
    kl_ctl: KLController
    publisher: WeightPublisher
    checkpoints: CheckpointWriter | None  # rank 0 only
    monitor: MakerMonitor | None  # rank 0 only
    rows: _Rows | None  # rank 0 only
    tokenizer: Any
    threads: _Threads
    group: int = 0  # this worker group's number at the coordinator (``_rewind_prompts``)
    start: float = 0.0  # when the first step began (``time.perf_counter``)


@dataclass(frozen=True)
class _Carry:
    """What one step hands the next: the policy version it trains at, and its pull if it was sent
    ahead (``trainer.prefetch``)."""

    version: int
    ahead: _PullAhead | None = None


@dataclass(frozen=True)
class _PullAhead:
    """A pull issued one step early (``trainer.prefetch``) by a background thread, which then
    fetches, unpacks and merges its items while this step trains; the step and version it is for."""

    sent: Future  # the pull's ref, once the thread has sent it
    fetched: Future  # (chunks, their items, the items merged into a batch or None)
    step: int
    version: int


@dataclass(frozen=True)
class _StepPlan:
    """What step ``step`` does besides training, decided alike on every rank: planned as the step
    begins (``_plan``), and made the last by the time budget once it has trained (``ending``)."""

    step: int
    version: int  # the policy version it trains at
    last: bool
    push: bool
    checkpoint: bool

    @property
    def next_version(self) -> int:
        """The version of the weights after this step: one up when it pushes."""
        return self.version + self.push

    def ending(self) -> _StepPlan:
        """This step as the run's last: it pushes and checkpoints."""
        return dataclasses.replace(self, last=True, push=True, checkpoint=True)


@dataclass(frozen=True)
class _StepResult:
    """What a trained step hands its report thread (``_complete_row``), read there only."""

    over_ranks: Callable[[], dict[str, float]]  # waits for the metrics all-reduce the step started
    own: dict[str, float]  # this rank's own figures (push time and bytes, step, version, ...), never averaged
    step_s: float
    items: list[ExperienceItem]  # the step's experience (samples.jsonl)
    state: dict[str, torch.Tensor]  # the gathered weights (empty unless pushed or checkpointed)


def _plan(t: TrainerConfig, step: int, version: int) -> _StepPlan:
    """Step ``step`` at ``version``: the last at ``total_steps``; pushes every ``update_steps`` and
    at the end; checkpoints every ``checkpoint_every`` and at the end."""
    last = step == t.total_steps
    return _StepPlan(step, version, last, push=step % t.update_steps == 0 or last,
                     checkpoint=bool(last or (t.checkpoint_every and step % t.checkpoint_every == 0)))


def train_loop_per_worker(loop_config: dict) -> None:
    """Pull experience, train, publish weights, checkpoint, report: ``trainer.total_steps`` times."""
    with coordinator_death_is_fatal():
        _train_loop(loop_config)


def _train_loop(loop_config: dict) -> None:
    cfg = Config.from_dict(loop_config["config"])
    rank = ray.train.get_context().get_world_rank()
    with _Threads(prefetch=cfg.trainer.prefetch, pushes=rank == 0) as threads:
        run, carry, first_step = _start(cfg, loop_config, threads)
        for step in range(first_step, cfg.trainer.total_steps + 1):
            carry = _train_step(run, carry, step)
            if carry is None:
                break


def _train_step(run: _Run, carry: _Carry, step: int) -> _Carry | None:
    """One step: pull -> train -> publish -> checkpoint -> report. What the next step starts from,
    or None after the run's last step."""
    start = time.perf_counter()
    plan = _plan(run.cfg.trainer, step, carry.version)
    items, batch, ahead = _pull_step(run, plan, carry.ahead)
    wait_s = time.perf_counter() - start
    metrics = _train(run, plan.version, items, batch)
    if not plan.last and broadcast_time_up(run.cfg.trainer.time_budget_s, run.start, run.device):
        plan = plan.ending()
    if plan.last:
        _cancel_pull_ahead(run, ahead)
    state, push_s, push_bytes = _publish(run, plan)
    step_s, elapsed_s = time.perf_counter() - start, time.perf_counter() - run.start
    metrics.update(trainer_idle_ratio=wait_s / step_s)
    checkpoint = _checkpoint(run, plan, state) if plan.checkpoint else None
    try:
        over_ranks = start_all_reduce_metrics(metrics, run.device)
        # Only rank 0 pushes, and only rank 0's row is kept: its own time and bytes, never a mean over ranks.
        own = dict(push_s=push_s, push_bytes=float(push_bytes), step=step, policy_version=plan.next_version,
                   kl_coef=run.kl_ctl.value, samples_per_s=run.cfg.trainer.train_batch_size * run.world / step_s,
                   elapsed_s=elapsed_s)
        _report(run, plan, _StepResult(over_ranks, own, step_s, items, state), checkpoint)
    finally:  # Ray Train has its copy (the report uploads in SYNC mode), or the step failed: the staged one is spent
        if checkpoint is not None:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
    return None if plan.last else _Carry(plan.next_version, ahead)


# -- start ------------------------------------------------------------------------------------------


def _start(cfg: Config, loop_config: dict, threads: _Threads) -> tuple[_Run, _Carry, int]:
    """This rank's models, learner and helpers, restored from a checkpoint if there is one, and
    the makers given the weights to start from; returns the run, what its first step starts
    from, and that step."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    device = ray.train.torch.get_device() if cfg.trainer.use_gpu else torch.device("cpu")
    coordinator = find_coordinator(RunHandles(**loop_config["handles"]))
    restored = restore_point(ray.train.get_checkpoint(), loop_config.get("resume_from"))
    learner = _build_learner(cfg, device, rank, restored, loop_config.get("learner_factory"))
    run = _Run(cfg, rank, world, device, coordinator, learner,
               kl_ctl=make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon),
               publisher=WeightPublisher(learner, CoordinatorClient(coordinator), cfg.sync.bucket_mb),
               checkpoints=CheckpointWriter(cfg) if rank == 0 else None,
               monitor=MakerMonitor(CoordinatorClient(coordinator), cfg.maker.engine == "vllm",
                                    streaming=cfg.maker.max_running > 0,
                                    dynamic_sampling=cfg.algo.dynamic_sampling) if rank == 0 else None,
               rows=_Rows(coordinator) if rank == 0 else None,
               tokenizer=load_tokenizer(tokenizer_path(cfg)), threads=threads)
    first_step, version = 1, 0
    if restored:
        learner.load_state(restored.optimizer)
        run.kl_ctl.load_state_dict(restored.run.kl_ctl)
        first_step, version = restored.run.step + 1, restored.run.policy_version
    version, group = _start_makers(run, restored is not None, first_step, version)
    return dataclasses.replace(run, group=group, start=time.perf_counter()), _Carry(version), first_step


def _build_learner(cfg: Config, device: torch.device, rank: int, restored: TrainerState | None,
                   learner_factory: Any) -> PPOLearner:
    """Actor and critic (with the checkpoint's weights when resuming) under the configured strategy."""
    actor, critic = build_actor(cfg), build_critic_if_needed(cfg)
    if restored:
        actor.load_state_dict(restored.actor)
        if critic is not None:
            critic.load_state_dict(restored_critic(restored.critic, cfg))
    strategy = make_strategy(cfg.trainer.strategy, device, cfg.trainer.max_grad_norm)
    learner_factory = learner_factory or PPOLearner  # benchmarks may simulate the update
    return learner_factory(actor, critic, strategy, cfg, seed=rank_seed(cfg.seed, rank))


def _start_makers(run: _Run, restored: bool, first_step: int, version: int) -> tuple[int, int]:
    """Rewind the prompts to ``first_step`` and, when makers must start from this group's weights
    (resumed, restarted, or ``maker.wait_for_weights``), publish them. Returns the version the
    first step trains at and this worker group's number."""
    # Versions never go backwards for makers: after a worker-group restart the coordinator may
    # already hold later pushes (made after the checkpoint, or with no checkpoint at all); the
    # weights this group starts from then get a new, higher version.
    latest = ray.get(run.coordinator.status.remote()).trainer_version
    behind = latest > version
    version = latest + 1 if behind else version
    group = _rewind_prompts(run.coordinator, first_step - 1, run.rank, run.device)
    if restored or behind or run.cfg.maker.wait_for_weights:  # makers start from these weights
        state = run.publisher.gather()
        if run.rank == 0:
            run.publisher.publish(state, version, run.kl_ctl.value)
    if run.rank == 0 and not (restored or behind) and run.cfg.eval.due(0, last=False):  # the base model
        run.coordinator.request_eval.remote(0, version)
    return version, group


# -- the phases of a step ---------------------------------------------------------------------------


def _pull_step(run: _Run, plan: _StepPlan, ahead: _PullAhead | None
               ) -> tuple[list[ExperienceItem], ExperienceBatch, _PullAhead | None]:
    """This rank's ``trainer.train_batch_size`` items for the step and their batch (pulled and
    merged while the previous step trained, with ``trainer.prefetch``), and the pull for the next
    step, sent now to be answered while this one trains."""
    t = run.cfg.trainer
    if ahead is not None and (ahead.step, ahead.version) != (plan.step, plan.version):
        raise RuntimeError(f"pulled ahead for step {ahead.step} at version {ahead.version}, "
                           f"but step {plan.step} trains at version {plan.version}")
    items, batch = _pull(run.coordinator, run.rank, t.train_batch_size, plan.version, t.pull_timeout_s, plan.step,
                         ahead.fetched if ahead else None, run.group)
    # The next step trains at the version this one is planned to push; a step the time budget makes
    # the last (``_StepPlan.ending``) cancels this pull.
    ahead = _pull_ahead(run, plan.step + 1, plan.version, plan.next_version) if t.prefetch and not plan.last else None
    batch = batch if batch is not None else ExperienceBatch.merge(items, run.tokenizer.pad_token_id)
    return items, batch, ahead


def _train(run: _Run, version: int, items: list[ExperienceItem], batch: ExperienceBatch) -> dict[str, float]:
    """PPO epochs on the items (merged in ``batch``); this rank's metrics. The KL controller sees
    this step's KL, the mean over the ranks when it adapts (a collective): every rank then holds
    the same coefficient, the one rank 0 pushes to the makers and checkpoints, and the KL loss
    term is alike on every rank."""
    train_start = time.perf_counter()
    run.learner.kl_coef = run.kl_ctl.value
    metrics = run.learner.train_step(batch, version=version)
    train_s = time.perf_counter() - train_start
    metrics.update(experience_metrics(items, version, run.cfg.ppo.uses_reference))
    kl = all_reduce_metrics({"kl": metrics["kl"]}, run.device)["kl"] if run.kl_ctl.adapts else metrics.get("kl", 0.0)
    run.kl_ctl.update(kl, run.cfg.trainer.train_batch_size * run.world)
    metrics.update(train_s=train_s)
    return metrics


def _publish(run: _Run, plan: _StepPlan) -> tuple[dict[str, torch.Tensor], float, int]:
    """Gather the weights when a push or a checkpoint needs them (a collective); on a push step
    rank 0 hands the push (at ``plan.next_version``) to the push thread, which puts the buckets
    and hands them to the coordinator while the next step runs (the gathered state is a copy, so
    training on does not change what is pushed). Returns (gathered state, seconds this step was
    held by the push, push bytes)."""
    state = run.publisher.gather() if plan.push or plan.checkpoint else {}
    if not plan.push or run.rank != 0:
        return state, 0.0, 0
    start = time.perf_counter()
    pusher = run.threads.pusher
    pusher.wait()  # the previous push, handed over a step or more ago; a failure of it is raised here
    lora_only = run.cfg.sync.lora_only
    push = run.publisher.to_push(state, lora_only)
    pusher.submit(run.publisher.publish, push, plan.next_version, run.kl_ctl.value, lora_only)
    if plan.last:  # the run's last push is handed over before the makers are checked against it
        pusher.wait()
    return state, time.perf_counter() - start, run.publisher.size(push)


def _checkpoint(run: _Run, plan: _StepPlan, state: dict[str, torch.Tensor]) -> ray.train.Checkpoint | None:
    """Gather the optimizer state (a collective); rank 0 writes the checkpoint and returns it."""
    optim_state = run.learner.full_state_dict()
    if run.rank != 0:
        return None
    run_state = RunState(step=plan.step, policy_version=plan.next_version, kl_ctl=run.kl_ctl.state_dict(),
                         data=ray.get(run.coordinator.data_state.remote(plan.step)))
    return ray.train.Checkpoint.from_directory(str(run.checkpoints.write(state, optim_state, run_state)))


def _report(run: _Run, plan: _StepPlan, result: _StepResult, checkpoint: ray.train.Checkpoint | None) -> None:
    """Hand the step's metrics row to the report thread, which completes it while the next step
    runs (``_complete_row``); every rank reports it to Ray Train when due, waiting for it then.
    Off the step's path: the metrics all-gather (started by every rank, so no rank waits there for
    the slowest one) and rank 0's calls to the coordinator (status read, metrics row), which would
    lengthen rank 0's step, and with it every rank's at the next collective."""
    reporter = run.threads.reporter
    reporter.wait()  # the previous step's row, done a step ago; a failure of it is raised here
    reporter.submit(_complete_row, run, plan, result)
    if plan.last or plan.checkpoint or plan.step % run.cfg.logging.report_every == 0:
        ray.train.report(reporter.wait(), checkpoint=checkpoint)
        if checkpoint is not None:
            _announce_checkpoint(run.coordinator, plan.step)


def _complete_row(run: _Run, plan: _StepPlan, result: _StepResult) -> dict[str, float]:
    """The step's metrics over the ranks with this rank's own figures; rank 0 completes and records
    the run's row (``_rank_0_row``). In the report thread."""
    metrics = {**drop_absent(result.over_ranks()), **result.own}
    return _rank_0_row(run, plan, result, metrics) if run.rank == 0 else metrics


def _rank_0_row(run: _Run, plan: _StepPlan, result: _StepResult, metrics: dict[str, float]) -> dict[str, float]:
    """Rank 0's row: the makers' view, the evaluation of this step's weights asked for when due, the
    evaluations finished since the previous row (at the end: every one asked for), and the step's
    samples; recorded at the coordinator. Returns the row without its evaluations (Ray Train's)."""
    metrics = {**metrics, **_makers_view(run, plan, result)}
    if plan.push and run.cfg.eval.due(plan.step, plan.last, run.cfg.trainer.update_steps):
        # waited for: the coordinator runs one caller's calls out of order
        ray.get(run.coordinator.request_eval.remote(plan.step, plan.next_version))
    row = attach_evals(metrics, run.monitor.evals(wait=plan.last))  # the last row waits for its own
    samples = step_samples(result.items, run.tokenizer, plan.step, run.cfg.logging.samples_every)
    run.rows.record({**row, SAMPLES_KEY: samples} if samples else row)
    return split_evals(row)[0]


def _makers_view(run: _Run, plan: _StepPlan, result: _StepResult) -> dict[str, float]:
    """The makers' throughput and counters since the previous row; at the end, also whether every
    maker holds the final weights (``weights_in_sync``)."""
    view = run.monitor.metrics(result.step_s, plan.step)
    if plan.last:
        held = as_held(result.state, run.cfg.engine_dtype, run.cfg.maker_dtype)  # pushes are cast to the makers' dtypes
        view["weights_in_sync"] = verify_makers(CoordinatorClient(run.coordinator), plan.next_version, fingerprint(held))
    return view


# -- calls to the coordinator -----------------------------------------------------------------------


class _Rows:
    """Rank 0's metrics rows, sent to the coordinator from the report thread."""

    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self.sent: ray.ObjectRef | None = None  # the last row's call

    def record(self, row: dict) -> None:
        """Send a row, not waiting for it, but only once the previous row is in: the coordinator is
        an async actor, and Ray does not promise to run one caller's calls to it in the order they
        were sent, so two rows sent back to back could land swapped. The previous row went a step
        ago, so the wait is for a call long done."""
        if self.sent is not None:
            ray.get(self.sent)
        self.sent = self.coordinator.record_metrics.remote(row)


def _announce_checkpoint(coordinator: Any, step: int) -> None:
    """Tell the driver, through the coordinator, where Ray Train stored the checkpoint of ``step``:
    it switches ``RUN_DIR/checkpoint`` to it while the run goes on. Rank 0 only."""
    for reported in reversed(ray.train.get_all_reported_checkpoints()):
        if reported.metrics.get("step") == step:
            ray.get(coordinator.checkpoint_saved.remote(step, reported.checkpoint))
            return


def _rewind_prompts(coordinator: Any, step: int, rank: int, device: torch.device) -> int:
    """Prompts trained after ``step`` by an earlier worker group of this run (``FailureConfig``
    restart) are served again, since their training was lost with its weights (nothing to serve
    again for a fresh or resumed run). Rank 0 asks; every rank gets the group number that its
    pulls carry, so no rank pulls before the rewind is done."""
    group = ray.get(coordinator.rewind.remote(step)) if rank == 0 else 0
    return broadcast_from_rank_0(group, device)


def _pull_call(coordinator: Any, *, rank: int, n: int, version: int, timeout_s: float, step: int,
               for_version: int | None = None, group: int | None = None) -> ray.ObjectRef:
    """The coordinator's ``pull`` of ``n`` items for ``step``, sent (not awaited)."""
    request = PullRequest(rank=rank, n=n, trainer_version=version, timeout_s=timeout_s, pid=os.getpid(), step=step,
                          for_version=for_version, group=group)
    return coordinator.pull.remote(request)


def _pull(coordinator: Any, rank: int, n: int, version: int, timeout_s: float, step: int,
          pending: Future | None = None, group: int | None = None) -> tuple[list[ExperienceItem], ExperienceBatch | None]:
    """``n`` items from the coordinator for ``step``, starting with the ``pending`` pull if one was
    sent ahead (``_pull_ahead``), and the batch that pull's thread merged them into when that pull
    alone brought them all (else None). Items lost with a dead maker are reported (their prompts are
    served again) and replaced. A pull ahead that timed out (its wait included the previous step's
    training) is sent again with the full timeout.
    The coordinator's errors (maker failure, stall) are re-raised as themselves, so the run's
    error message is the coordinator's one-line diagnosis."""
    items: list[ExperienceItem] = []
    batch = None
    while len(items) < n:
        try:
            if pending is not None:
                _, fetched, batch = pending.result()
            else:
                batch = None  # the items came from more than one pull: the caller merges them
                _, fetched = _fetch(_pull_call(coordinator, rank=rank, n=n - len(items), version=version,
                                               timeout_s=timeout_s, step=step, group=group))
        except ray.exceptions.RayTaskError as e:
            if pending is not None and isinstance(e.as_instanceof_cause(), TimeoutError):
                pending = None
                continue
            raise e.as_instanceof_cause() from None
        pending = None
        if fetched is None:
            raise RuntimeError(f"the coordinator cancelled rank {rank}'s pull for step {step}: "
                               "this worker group was replaced")
        if fetched.lost:
            ray.get(coordinator.lost_in_transit.remote(ItemsLost(rank, fetched.lost, tuple(fetched.lost_prompt_ids), version)))
        items += fetched.items
    return items, batch


def _fetch(ref: ray.ObjectRef) -> tuple[list[ExperienceChunk] | None, Fetched | None]:
    """The chunks a pull returned and their items (None, None for a pull that brought nothing:
    cancelled, or from a replaced worker group)."""
    reply = ray.get(ref)
    return (reply.chunks, resolve(reply.chunks, fetch_objects)) if reply.pulled else (None, None)


def _pull_ahead(run: _Run, step: int, trainer_version: int, version: int) -> _PullAhead:
    """Send the pull for ``step`` (to train at ``version``; the trainer is at ``trainer_version``)
    from the pull thread, which then fetches, unpacks and merges its items: the step being trained
    waits for none of it."""
    t, sent = run.cfg.trainer, Future()
    call = functools.partial(_pull_call, run.coordinator, rank=run.rank, n=t.train_batch_size, version=trainer_version,
                             timeout_s=t.pull_timeout_s, step=step, for_version=version, group=run.group)
    pad_token_id = run.tokenizer.pad_token_id

    def send_and_fetch():
        try:
            ref = call()
        except BaseException as e:
            sent.set_exception(e)
            raise
        sent.set_result(ref)
        chunks, fetched = _fetch(ref)
        batch = None
        if fetched is not None and fetched.items and not fetched.lost:
            try:
                batch = ExperienceBatch.merge(fetched.items, pad_token_id)
            except ValueError:
                pass  # an item that cannot be merged: the step's own merge raises it, if the step runs
        return chunks, fetched, batch

    return _PullAhead(sent, run.threads.puller.submit(send_and_fetch), step, version)


class _Background:
    """A daemon thread (a failed step leaves nothing to join) that runs the calls handed to it,
    one after another; each call's result or error comes from its future. One lives as long as
    the loop, since a thread started per call would hold the step: ``Thread.start`` waits for the
    new thread, which then keeps the GIL through its call's first Python work (up to
    ``sys.getswitchinterval()``). Not a ``ThreadPoolExecutor``: its
    threads are joined at interpreter exit, so a pull blocked until its timeout would hold a
    failed worker's exit."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.last: Future | None = None  # the last call handed over, until waited for
        threading.Thread(target=self._serve, name=f"ray_ppo-{name}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args))
        self.last = future
        return future

    def wait(self) -> Any:
        """The result of the last call handed over (its error is raised here); None if it was
        already waited for, or there was none. Only the thread that hands calls over waits."""
        last, self.last = self.last, None
        return last.result() if last is not None else None

    def close(self) -> None:
        """End the thread once the calls handed to it are done (not waiting for them)."""
        self.calls.put(None)

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            future, fn, args = call
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)


class _Threads:
    """The loop's background threads, started together and closed together (``with``): the pull
    thread sends, fetches and merges the pulls sent ahead (``trainer.prefetch``); the push thread
    (rank 0) puts the pushes and hands them over; the report thread completes (and on rank 0
    records) each step's metrics row."""

    def __init__(self, prefetch: bool, pushes: bool):
        self.puller = _Background("pull") if prefetch else None
        self.pusher = _Background("push") if pushes else None
        self.reporter = _Background("report")

    def __enter__(self) -> _Threads:
        return self

    def __exit__(self, *exc: Any) -> None:
        for thread in (self.puller, self.pusher, self.reporter):
            if thread is not None:
                thread.close()


def _cancel_pull_ahead(run: _Run, ahead: _PullAhead | None) -> None:
    """The run's last step: the pull sent ahead for a next step is cancelled if it still waits, or
    its items are handed back to the coordinator (untrained, so neither consumed nor lost)."""
    if ahead is None:
        return
    try:
        ahead.sent.result()
    except Exception:
        return  # it was never sent
    ray.get(run.coordinator.cancel_pull.remote(run.rank, os.getpid()))
    try:
        chunks, _, _ = ahead.fetched.result()
    except ray.exceptions.RayTaskError:
        return  # it failed (a maker failure, a stall): it took nothing
    if chunks:
        ray.get(run.coordinator.hand_back.remote(run.rank, chunks, ahead.version))


@contextlib.contextmanager
def coordinator_death_is_fatal():
    """Turn the death of the coordinator, seen by any call to it, into one clear error.

    Decision (see docs/failures.md): the coordinator holds the experience buffers,
    the counters and the prompt position, so it is not restarted; the run ends and is resumed
    from its last checkpoint.
    """
    try:
        yield
    except ray.exceptions.RayActorError as e:
        if "Coordinator" not in str(e):
            raise
        raise RuntimeError(
            "the coordinator actor died, and with it the experience buffers and the run's counters; "
            "the run cannot continue. Resume from the last checkpoint (ray-ppo train --resume RUN_DIR or "
            f"PPOTrainer(..., resume_from=...)). Cause: {str(e).splitlines()[0]}") from None

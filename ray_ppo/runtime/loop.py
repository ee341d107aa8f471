"""``train_loop_per_worker`` for the detached PPO ``TorchTrainer``: the loop and nothing else.

Each step reads top to bottom: pull -> train -> publish -> checkpoint -> report. The parts live
with their kind: the weight publisher in ``ray_ppo.runtime.publish``, the checkpoint writer in
``ray_ppo.core.checkpoint``, the statistics in ``ray_ppo.core.metrics`` and ``ray_ppo.runtime.monitor``, and the
step's collectives, named for what they synchronise, in ``ray_ppo.core.collectives``.
"""

from __future__ import annotations

import contextlib
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

from ray_ppo.config import Config
from ray_ppo.core.algo import ExperienceBatch, ExperienceItem, KLController, make_kl_controller
from ray_ppo.core.build import build_actor, build_critic_if_needed, tokenizer_path
from ray_ppo.core.checkpoint import CheckpointWriter, TrainerState, restore_point, restored_critic
from ray_ppo.core.collectives import all_reduce_metrics, broadcast_from_rank_0, broadcast_time_up, start_all_reduce_metrics
from ray_ppo.core.learner import PPOLearner, drop_absent
from ray_ppo.core.metrics import experience_metrics
from ray_ppo.core.models import load_tokenizer
from ray_ppo.core.strategies import make_strategy
from ray_ppo.core.sync import fingerprint
from ray_ppo.eval_records import attach_evals, split_evals
from ray_ppo.runtime.messages import ItemsLost, PullRequest, RunHandles
from ray_ppo.runtime.monitor import MakerMonitor, verify_makers
from ray_ppo.runtime.publish import WeightPublisher
from ray_ppo.runtime.transport import ExperienceChunk, Fetched, resolve
from ray_ppo.samples import SAMPLES_KEY, pick_samples, samples_due


@dataclass
class _Worker:
    """What one rank's loop holds from step to step."""

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
    tokenizer: Any
    version: int = 0
    run_start: float = 0.0
    puller: _Background | None = None  # sends, fetches and merges the pulls ahead
    pusher: _Background | None = None  # rank 0: puts the pushes and hands them over
    reporter: _Background | None = None  # completes (and on rank 0 records) each step's metrics row
    ahead: _PullAhead | None = None  # the next step's pull, in flight while this step trains
    pushing: Future | None = None  # rank 0: the last push, being put and handed over in the background
    reporting: Future | None = None  # the last step's metrics row, being completed in the background
    group: int | None = None  # this worker group's number at the coordinator (``_rewind_prompts``)
    recorded: Any = None  # rank 0: the ref of the last metrics row sent (``_record``)


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
    """What step ``step`` does besides training, decided alike on every rank."""

    step: int
    last: bool
    push: bool
    checkpoint: bool


def train_loop_per_worker(loop_config: dict) -> None:
    """Pull experience, train, publish weights, checkpoint, report: ``trainer.total_steps`` times."""
    with coordinator_death_is_fatal():
        _train_loop(loop_config)


def _train_loop(loop_config: dict) -> None:
    worker, first_step = _start_worker(loop_config)
    worker.run_start = time.perf_counter()
    try:
        for step in range(first_step, worker.cfg.trainer.total_steps + 1):
            if _train_step(worker, step):
                break
    finally:
        for thread in (worker.puller, worker.pusher, worker.reporter):
            if thread is not None:
                thread.close()


def _train_step(w: _Worker, step: int) -> bool:
    """One step: pull -> train -> publish -> checkpoint -> report. True after the run's last step."""
    start = time.perf_counter()
    items, batch = _pull_step(w, step)
    wait_s = time.perf_counter() - start
    metrics = _train(w, items, batch)
    plan = _plan(w, step)
    if plan.last:
        _cancel_pull_ahead(w)
    state, push_s, push_bytes = _publish(w, plan)
    step_s, elapsed_s = time.perf_counter() - start, time.perf_counter() - w.run_start
    metrics.update(trainer_idle_ratio=wait_s / step_s)
    checkpoint = _checkpoint(w, step, state) if plan.checkpoint else None
    try:
        over_ranks = start_all_reduce_metrics(metrics, w.device)
        # Only rank 0 pushes, and only rank 0's row is kept: its own time and bytes, never a mean over ranks.
        own = dict(push_s=push_s, push_bytes=float(push_bytes), step=step, policy_version=w.version,
                   kl_coef=w.kl_ctl.value, samples_per_s=w.cfg.trainer.train_batch_size * w.world / step_s,
                   elapsed_s=elapsed_s)
        _report(w, plan, over_ranks, own, step_s, items, state, checkpoint)
    finally:  # Ray Train has its copy (the report uploads in SYNC mode), or the step failed: the staged one is spent
        if checkpoint is not None:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
    return plan.last


# -- start ------------------------------------------------------------------------------------------


def _start_worker(loop_config: dict) -> tuple[_Worker, int]:
    """This rank's models, learner and helpers, restored from a checkpoint if there is one, and
    the makers given the weights to start from; returns the worker and its first step."""
    cfg = Config.from_dict(loop_config["config"])
    handles = RunHandles(**loop_config["handles"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    device = ray.train.torch.get_device() if cfg.trainer.use_gpu else torch.device("cpu")
    coordinator = handles.coordinator()
    restored = restore_point(ray.train.get_checkpoint(), loop_config.get("resume_from"))
    learner = _build_learner(cfg, device, rank, restored, loop_config.get("learner_factory"))
    w = _Worker(cfg, rank, world, device, coordinator, learner,
                kl_ctl=make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon),
                publisher=WeightPublisher(learner, coordinator, cfg.sync.bucket_mb),
                checkpoints=CheckpointWriter(cfg) if rank == 0 else None,
                monitor=MakerMonitor(coordinator, cfg.maker.engine == "vllm") if rank == 0 else None,
                tokenizer=load_tokenizer(tokenizer_path(cfg)),
                puller=_Background("pull") if cfg.trainer.prefetch else None,
                pusher=_Background("push") if rank == 0 else None, reporter=_Background("report"))
    first_step = 1
    if restored:
        learner.load_state(restored.optimizer)
        w.kl_ctl.load_state_dict(restored.run["kl_ctl"])
        first_step, w.version = restored.run["step"] + 1, restored.run["policy_version"]
    _start_makers(w, restored is not None, first_step)
    return w, first_step


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
    return learner_factory(actor, critic, strategy, cfg, seed=cfg.seed + rank)


def _start_makers(w: _Worker, restored: bool, first_step: int) -> None:
    """Rewind the prompts to ``first_step`` and, when makers must start from this group's weights
    (resumed, restarted, or ``maker.wait_for_weights``), publish them."""
    # Versions never go backwards for makers: after a worker-group restart the coordinator may
    # already hold later pushes (made after the checkpoint, or with no checkpoint at all); the
    # weights this group starts from then get a new, higher version.
    latest = ray.get(w.coordinator.status.remote()).trainer_version
    behind = latest > w.version
    w.version = latest + 1 if behind else w.version
    w.group = _rewind_prompts(w.coordinator, first_step - 1, w.rank, w.device)
    if restored or behind or w.cfg.maker.wait_for_weights:  # makers start from these weights
        state = w.publisher.gather()
        if w.rank == 0:
            w.publisher.publish(state, w.version, w.kl_ctl.value)
    if w.rank == 0 and not (restored or behind) and w.cfg.eval.due(0, last=False):  # the base model
        w.coordinator.request_eval.remote(0, w.version)


# -- the phases of a step ---------------------------------------------------------------------------


def _pull_step(w: _Worker, step: int) -> tuple[list[ExperienceItem], ExperienceBatch]:
    """This rank's ``trainer.train_batch_size`` items for ``step`` and their batch (pulled and
    merged while the previous step trained, with ``trainer.prefetch``), then the pull for the next
    step is sent, to be answered while this one trains."""
    t = w.cfg.trainer
    ahead, w.ahead = w.ahead, None
    if ahead is not None and (ahead.step, ahead.version) != (step, w.version):
        raise RuntimeError(f"pulled ahead for step {ahead.step} at version {ahead.version}, "
                           f"but step {step} trains at version {w.version}")
    items, batch = _pull(w.coordinator, w.rank, t.train_batch_size, w.version, t.pull_timeout_s, step,
                         ahead.fetched if ahead else None, w.group)
    if t.prefetch and step < t.total_steps:
        # The next step trains at the version this step pushes, if it pushes on schedule; a step
        # that pushes off schedule is the run's last (``_plan``), whose pull ahead is cancelled.
        w.ahead = _pull_ahead(w, step + 1, w.version + (step % t.update_steps == 0))
    return items, batch if batch is not None else ExperienceBatch.merge(items, w.tokenizer.pad_token_id)


def _train(w: _Worker, items: list[ExperienceItem], batch: ExperienceBatch) -> dict[str, float]:
    """PPO epochs on the items (merged in ``batch``); this rank's metrics. The KL controller sees
    this step's KL, the mean over the ranks when it adapts (a collective): every rank then holds
    the same coefficient, the one rank 0 pushes to the makers and checkpoints, and the KL loss
    term is alike on every rank."""
    train_start = time.perf_counter()
    w.learner.kl_coef = w.kl_ctl.value
    metrics = w.learner.train_step(batch, version=w.version)
    train_s = time.perf_counter() - train_start
    metrics.update(experience_metrics(items, w.version))
    kl = all_reduce_metrics({"kl": metrics["kl"]}, w.device)["kl"] if w.kl_ctl.adapts else metrics["kl"]
    w.kl_ctl.update(kl, w.cfg.trainer.train_batch_size * w.world)
    metrics.update(train_s=train_s)
    return metrics


def _plan(w: _Worker, step: int) -> _StepPlan:
    """Whether ``step`` is the last (``total_steps`` or the time budget: a broadcast), pushes, checkpoints."""
    t = w.cfg.trainer
    last = step == t.total_steps or broadcast_time_up(t.time_budget_s, w.run_start, w.device)
    return _StepPlan(step, last, push=step % t.update_steps == 0 or last,
                     checkpoint=bool(last or (t.checkpoint_every and step % t.checkpoint_every == 0)))


def _publish(w: _Worker, plan: _StepPlan) -> tuple[dict[str, torch.Tensor], float, int]:
    """Gather the weights when a push or a checkpoint needs them (a collective); on a push step
    the version goes up and rank 0 hands the push to a background thread, which puts the buckets
    and hands them to the coordinator while the next step runs (the gathered state is a copy, so
    training on does not change what is pushed). Returns (gathered state, seconds this step was
    held by the push, push bytes)."""
    state = w.publisher.gather() if plan.push or plan.checkpoint else {}
    if not plan.push:
        return state, 0.0, 0
    w.version += 1
    if w.rank != 0:
        return state, 0.0, 0
    start = time.perf_counter()
    _wait_for_push(w)  # the previous push, handed over a step or more ago; a failure of it is raised here
    lora_only = w.cfg.sync.lora_only
    push = w.publisher.to_push(state, lora_only)
    w.pushing = w.pusher.submit(w.publisher.publish, push, w.version, w.kl_ctl.value, lora_only)
    if plan.last:  # the run's last push is handed over before the makers are checked against it
        _wait_for_push(w)
    return state, time.perf_counter() - start, w.publisher.size(push)


def _wait_for_push(w: _Worker) -> None:
    pushing, w.pushing = w.pushing, None
    if pushing is not None:
        pushing.result()


def _checkpoint(w: _Worker, step: int, state: dict[str, torch.Tensor]) -> ray.train.Checkpoint | None:
    """Gather the optimizer state (a collective); rank 0 writes the checkpoint and returns it."""
    optim_state = w.learner.full_state_dict()
    if w.rank != 0:
        return None
    run_state = {"step": step, "policy_version": w.version, "kl_ctl": w.kl_ctl.state_dict(),
                 "data": ray.get(w.coordinator.data_state.remote(step))}
    return ray.train.Checkpoint.from_directory(str(w.checkpoints.write(state, optim_state, run_state)))


def _report(w: _Worker, plan: _StepPlan, over_ranks: Callable[[], dict[str, float]], own: dict[str, float],
            step_s: float, items: list[ExperienceItem], state: dict[str, torch.Tensor],
            checkpoint: ray.train.Checkpoint | None) -> None:
    """Hand the step's metrics row to the report thread, which completes it while the next step
    runs (``_complete_row``); every rank reports it to Ray Train when due, waiting for it then.
    Off the step's path: the metrics all-gather (started by every rank, so no rank waits there for
    the slowest one) and rank 0's calls to the coordinator (status read, metrics row), which would
    lengthen rank 0's step, and with it every rank's at the next collective."""
    _wait_for_report(w)  # the previous step's row, done a step ago; a failure of it is raised here
    w.reporting = w.reporter.submit(_complete_row, w, plan, over_ranks, own, step_s, items, state)
    if plan.last or plan.checkpoint or plan.step % w.cfg.logging.report_every == 0:
        ray.train.report(w.reporting.result(), checkpoint=checkpoint)
        if checkpoint is not None:
            _announce_checkpoint(w.coordinator, plan.step)


def _complete_row(w: _Worker, plan: _StepPlan, over_ranks: Callable[[], dict[str, float]], own: dict[str, float],
                  step_s: float, items: list[ExperienceItem], state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The step's metrics over the ranks with this rank's own figures. Rank 0 adds the makers' view
    (and, at the end, whether they hold the final weights), asks for the evaluation of this step's
    weights when due (``eval``), adds the evaluations finished since its previous row (at the
    end: every one asked for) and records the row. In the report
    thread: reads only what this step handed it (the version in ``own``, not ``w.version``)."""
    metrics = {**drop_absent(over_ranks()), **own}
    if w.rank == 0:
        metrics.update(w.monitor.metrics(step_s, plan.step))
        if plan.last:
            metrics["weights_in_sync"] = verify_makers(w.coordinator, int(own["policy_version"]), fingerprint(state))
        if plan.push and w.cfg.eval.due(plan.step, plan.last, w.cfg.trainer.update_steps):
            # waited for: the coordinator runs one caller's calls out of order
            ray.get(w.coordinator.request_eval.remote(plan.step, int(own["policy_version"])))
        row = attach_evals(metrics, w.monitor.evals(wait=plan.last))  # the last row waits for its own
        metrics = split_evals(row)[0]
        due = samples_due(plan.step, w.cfg.logging.samples_every)
        samples = pick_samples(items, w.tokenizer, plan.step) if due else []
        _record(w, {**row, SAMPLES_KEY: samples} if samples else row)
    return metrics


def _wait_for_report(w: _Worker) -> None:
    reporting, w.reporting = w.reporting, None
    if reporting is not None:
        reporting.result()


# -- calls to the coordinator -----------------------------------------------------------------------


def _record(w: _Worker, row: dict) -> None:
    """Send a metrics row to the coordinator, not waiting for it, but only once the previous row
    is in: the coordinator is an async actor, and Ray does not promise to run one caller's calls
    to it in the order they were sent, so two rows sent back to back could land swapped. The
    previous row went a step ago, so the wait is for a call long done. Report thread only."""
    if w.recorded is not None:
        ray.get(w.recorded)
    w.recorded = w.coordinator.record_metrics.remote(row)


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


def _pull_call(coordinator: Any, rank: int, n: int, version: int, timeout_s: float, step: int,
               for_version: int | None = None, group: int | None = None) -> ray.ObjectRef:
    """The coordinator's ``pull`` of ``n`` items for ``step``, sent (not awaited)."""
    return coordinator.pull.remote(PullRequest(rank, n, version, timeout_s, os.getpid(), step, for_version, group))


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
                _, fetched = _fetch(_pull_call(coordinator, rank, n - len(items), version, timeout_s, step, group=group))
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
    return (reply.chunks, resolve(reply.chunks)) if reply.pulled else (None, None)


def _pull_ahead(w: _Worker, step: int, version: int) -> _PullAhead:
    """Send the pull for ``step`` (to train at ``version``) from the pull thread, which then
    fetches, unpacks and merges its items: the step being trained waits for none of it."""
    t, sent = w.cfg.trainer, Future()
    call = (w.coordinator, w.rank, t.train_batch_size, w.version, t.pull_timeout_s, step, version, w.group)
    pad_token_id = w.tokenizer.pad_token_id

    def send_and_fetch():
        try:
            ref = _pull_call(*call)  # with the version and group of now, not of when the thread runs
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

    return _PullAhead(sent, w.puller.submit(send_and_fetch), step, version)


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
        threading.Thread(target=self._serve, name=f"ray_ppo-{name}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args))
        return future

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


def _cancel_pull_ahead(w: _Worker) -> None:
    """The run's last step: the pull sent ahead for a next step is cancelled if it still waits, or
    its items are handed back to the coordinator (untrained, so neither consumed nor lost)."""
    ahead, w.ahead = w.ahead, None
    if ahead is None:
        return
    try:
        ahead.sent.result()
    except Exception:
        return  # it was never sent
    ray.get(w.coordinator.cancel_pull.remote(w.rank, os.getpid()))
    try:
        chunks, _, _ = ahead.fetched.result()
    except ray.exceptions.RayTaskError:
        return  # it failed (a maker failure, a stall): it took nothing
    if chunks:
        ray.get(w.coordinator.hand_back.remote(w.rank, chunks, ahead.version))


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

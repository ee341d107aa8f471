"""``train_loop_per_worker`` for the detached PPO ``TorchTrainer``.

Each step reads top to bottom: pull -> PPO epochs -> publish weights -> report.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem, make_kl_controller
from ray_ppo.checkpoint import load_trainer_state, write_trainer_state
from ray_ppo.build import build_actor, build_critic_if_needed, learner_params, tokenizer_path
from ray_ppo.config import Config
from ray_ppo.messages import PushHeader
from ray_ppo.models import load_tokenizer
from ray_ppo.models.lora import trainable_names
from ray_ppo.samples import SAMPLES_KEY, pick_samples, samples_due
from ray_ppo.sync import fingerprint, join_state, make_buckets, push_aliases, push_size, split_state
from ray_ppo.train.learner import PPOLearner, drop_absent
from ray_ppo.train.strategies import make_strategy
from ray_ppo.transport import resolve

VERIFY_TIMEOUT_S = 60.0
"""How long the last step waits for every maker to load the final push before comparing weights."""


@dataclass
class RunHandles:
    """What a worker needs to find the run's actors."""

    namespace: str
    coordinator_name: str = "coordinator"


def experience_metrics(items: list[ExperienceItem], version: int) -> dict[str, float]:
    """Reward, KL, length and staleness statistics of the items of one step."""
    rewards = torch.tensor([it.reward for it in items])
    lengths = torch.tensor([it.response_length for it in items], dtype=torch.float32)
    kl = torch.cat([it.action_log_probs - it.ref_log_probs for it in items])
    staleness = torch.tensor([version - it.policy_version for it in items], dtype=torch.float32)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(items) > 1 else 0.0,
            "kl": float(kl.mean()), "response_length": float(lengths.mean()),
            "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}


def reduce_across_ranks(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean over ranks (max for ``*_max`` keys); identity in a single process. A nan (a statistic
    a rank has no data for, e.g. ``behaviour_kl_stale_<s>``) is left out of the mean: nan only
    when every rank has nan."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return metrics
    keys = sorted(metrics)
    means = [k for k in keys if not k.endswith("_max")]
    maxes = [k for k in keys if k.endswith("_max")]
    out = dict(metrics)
    if means:
        t = torch.tensor([metrics[k] for k in means], dtype=torch.float64, device=device)
        t = torch.stack([torch.nan_to_num(t, nan=0.0), (~torch.isnan(t)).double()])
        torch.distributed.all_reduce(t)
        out.update(zip(means, (t[0] / t[1]).tolist()))  # 0 / 0 = nan where no rank had a value
    if maxes:
        t = torch.tensor([metrics[k] for k in maxes], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        out.update(zip(maxes, t.tolist()))
    return out


class WeightPublisher:
    """Rank 0 side of a push: gather full state dicts, cut buckets, ``ray.put`` each once and hand
    its ref to the coordinator at once (makers stage bucket k while rank 0 puts k+1). Every rank
    must call ``gather`` (it is a collective)."""

    def __init__(self, learner: PPOLearner, coordinator: Any, bucket_mb: float, rank: int):
        self.learner, self.coordinator, self.bucket_mb, self.rank = learner, coordinator, bucket_mb, rank
        self.handed: list = []  # the coordinator's acknowledgements of the last push, checked at the next one
        unwrap = learner.strategy.unwrap
        critic = unwrap(learner.critic) if learner.critic is not None else None
        self.trainable = {f"actor.{n}" for n in trainable_names(unwrap(learner.actor))}
        self.trainable |= {f"critic.{n}" for n in trainable_names(critic)} if critic is not None else set()
        self.aliases = push_aliases(unwrap(learner.actor), critic)

    def gather(self) -> dict[str, torch.Tensor]:
        """Full actor and critic state dicts, keys prefixed ``actor.`` / ``critic.`` (no ``critic.``
        keys without a critic: a critic-free push carries the actor alone)."""
        strategy, critic = self.learner.strategy, self.learner.critic
        return join_state(strategy.full_state_dict(self.learner.actor),
                          strategy.full_state_dict(critic) if critic is not None else {})

    def to_push(self, state: dict[str, torch.Tensor], lora_only: bool) -> dict[str, torch.Tensor]:
        """What a push carries: every tensor once (tied aliases dropped; makers re-tie them), or
        with ``sync.lora_only`` only the adapters and other trainable tensors (value head)."""
        keep = self.trainable if lora_only else set(state) - self.aliases
        return {k: v for k, v in state.items() if k in keep}

    def publish(self, state: dict[str, torch.Tensor], version: int, kl_coef: float,
                partial: bool = False) -> tuple[float, int]:
        """Put the buckets, each handed on as soon as it is put; returns (seconds, bytes). Rank 0 only.

        The calls are not waited for: the coordinator runs them in order, before this rank's next
        call, and the next push checks that the previous one's calls succeeded."""
        start = time.perf_counter()
        ray.get(self.handed)
        num_chunks, nbytes = push_size(state, self.bucket_mb)
        header = PushHeader(version, num_chunks, nbytes, kl_coef, partial)
        self.handed = [self.coordinator.publish_start.remote(header)]
        self.handed += [self.coordinator.publish_chunk.remote(version, index, [ray.put(bucket)])
                        for index, bucket in enumerate(make_buckets(state, self.bucket_mb))]
        return time.perf_counter() - start, nbytes


class CheckpointWriter:
    """Rank 0 writes actor and critic (``save_pretrained``, safetensors; no critic for the
    critic-free estimators), tokenizer, optimizer state and run state into a fresh directory that
    becomes a ``ray.train.Checkpoint``."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._actor = self._critic = None  # CPU copies that receive full state dicts before saving

    def write(self, state: dict[str, torch.Tensor], optim_state: dict, run_state: dict) -> ray.train.Checkpoint:
        if self._actor is None:
            self._actor, self._critic = build_actor(self.cfg), build_critic_if_needed(self.cfg)
        actor_state, critic_state = split_state(state)
        self._actor.load_state_dict(actor_state)
        directory = Path(tempfile.mkdtemp(prefix="ray_ppo_ckpt_"))
        try:
            self._actor.save_pretrained(directory / "actor")
            load_tokenizer(tokenizer_path(self.cfg)).save_pretrained(directory / "actor")
            if self._critic is not None:
                self._critic.load_state_dict(critic_state)
                self._critic.save_pretrained(directory / "critic")
            write_trainer_state(directory, actor_state, critic_state if self._critic is not None else None,
                                optim_state, run_state)
        except OSError as e:  # a full disk: no partial checkpoint is left, the previous one is intact
            shutil.rmtree(directory, ignore_errors=True)
            raise OSError(e.errno, f"the checkpoint of step {run_state['step']} could not be written ({e}); "
                                   f"RUN_DIR/checkpoint still holds the previous one: free space, then "
                                   f"ray-ppo train --resume RUN_DIR") from None
        return ray.train.Checkpoint.from_directory(str(directory))


def _restore_point(resume_from: str | None) -> tuple[dict, dict, dict, dict] | None:
    """The state to resume from, validated: this run's latest checkpoint if Ray Train restarted
    the worker group (``FailureConfig``), else the ``resume_from`` directory; None for a fresh run."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            return load_trainer_state(directory)
    return load_trainer_state(resume_from) if resume_from else None


def train_loop_per_worker(loop_config: dict) -> None:
    """Pull experience, train, publish weights, report: ``trainer.total_steps`` times."""
    with coordinator_death_is_fatal():
        _train_loop(loop_config)


def _train_loop(loop_config: dict) -> None:
    cfg = Config.from_dict(loop_config["config"])
    handles = RunHandles(**loop_config["handles"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    device = ray.train.torch.get_device() if cfg.trainer.use_gpu else torch.device("cpu")
    coordinator = ray.get_actor(handles.coordinator_name, namespace=handles.namespace)

    restored = _restore_point(loop_config.get("resume_from"))
    actor, critic = build_actor(cfg), build_critic_if_needed(cfg)
    if restored:
        actor.load_state_dict(restored[0])
        if critic is not None:
            critic.load_state_dict(_restored_critic(restored[1], cfg))
    strategy = make_strategy(cfg.trainer.strategy, device, cfg.trainer.max_grad_norm)
    learner_factory = loop_config.get("learner_factory") or PPOLearner  # benchmarks may simulate the update
    learner = learner_factory(actor, critic, strategy, learner_params(cfg), seed=cfg.seed + rank)
    kl_ctl = make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
    publisher = WeightPublisher(learner, coordinator, cfg.sync.bucket_mb, rank)
    checkpoints = CheckpointWriter(cfg) if rank == 0 else None
    monitor = MakerMonitor(coordinator, cfg.maker.engine == "vllm") if rank == 0 else None
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    pad_token_id = tokenizer.pad_token_id
    first_step, version = 1, 0
    if restored:
        optim_state, run_state = restored[2], restored[3]
        learner.load_state(optim_state)
        kl_ctl.load_state_dict(run_state["kl_ctl"])
        first_step, version = run_state["step"] + 1, run_state["policy_version"]
    # Versions never go backwards for makers: after a worker-group restart the coordinator may
    # already hold later pushes (made after the checkpoint, or with no checkpoint at all); the
    # weights this group starts from then get a new, higher version.
    latest = ray.get(coordinator.status.remote()).trainer_version
    behind = latest > version
    version = latest + 1 if behind else version
    _rewind_prompts(coordinator, first_step - 1, rank)
    if restored or behind or cfg.maker.wait_for_weights:  # makers start from these weights
        state = publisher.gather()
        if rank == 0:
            publisher.publish(state, version, kl_ctl.value)

    run_start = time.perf_counter()
    for step in range(first_step, cfg.trainer.total_steps + 1):
        step_start = time.perf_counter()
        items = _pull(coordinator, rank, cfg.trainer.train_batch_size, version, cfg.trainer.pull_timeout_s, step)
        wait_s = time.perf_counter() - step_start
        if monitor:
            monitor.request()  # answered while this rank trains

        train_start = time.perf_counter()
        learner.kl_coef = kl_ctl.value
        metrics = learner.train_step(ExperienceBatch.merge(items, pad_token_id), version=version)
        train_s = time.perf_counter() - train_start
        metrics.update(experience_metrics(items, version))
        kl_ctl.update(metrics["kl"], cfg.trainer.train_batch_size * world)

        is_last = step == cfg.trainer.total_steps or _over_budget(cfg.trainer.time_budget_s, run_start, device)
        push_due = step % cfg.trainer.update_steps == 0 or is_last
        ckpt_due = is_last or (cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0)
        state = publisher.gather() if push_due or ckpt_due else {}
        optim_state = learner.full_state_dict() if ckpt_due else {}
        push_s, push_bytes = 0.0, 0
        if push_due:
            version += 1
            if rank == 0:
                push_s, push_bytes = publisher.publish(publisher.to_push(state, cfg.sync.lora_only), version,
                                                       kl_ctl.value, partial=cfg.sync.lora_only)

        step_s = time.perf_counter() - step_start
        metrics.update(train_s=train_s, trainer_idle_ratio=wait_s / step_s)
        metrics = drop_absent(reduce_across_ranks(metrics, device))
        # Only rank 0 pushes, and only rank 0's row is kept: its own time and bytes, never a mean over ranks.
        metrics.update(push_s=push_s, push_bytes=float(push_bytes))
        metrics.update(step=step, policy_version=version, kl_coef=kl_ctl.value,
                       samples_per_s=cfg.trainer.train_batch_size * world / step_s,
                       elapsed_s=time.perf_counter() - run_start)
        checkpoint = None
        if rank == 0:
            metrics.update(monitor.metrics(step_s))
            if is_last:
                metrics["weights_in_sync"] = _verify_makers(coordinator, version, fingerprint(state))
            if ckpt_due:
                run_state = {"step": step, "policy_version": version, "kl_ctl": kl_ctl.state_dict(),
                             "data": ray.get(coordinator.data_state.remote(step))}
                checkpoint = checkpoints.write(state, optim_state, run_state)
            samples = pick_samples(items, tokenizer, step) if samples_due(step, cfg.logging.samples_every) else []
            coordinator.record_metrics.remote({**metrics, SAMPLES_KEY: samples} if samples else metrics)
        if is_last or ckpt_due or step % cfg.logging.report_every == 0:
            ray.train.report(metrics, checkpoint=checkpoint)
            if checkpoint is not None:
                _announce_checkpoint(coordinator, step)
        if is_last:
            break


def _over_budget(budget_s: float, run_start: float, device: torch.device) -> bool:
    """The loop has run ``budget_s`` seconds (0 = no budget), decided alike on every rank (rank 0's
    clock: a collective when a process group exists)."""
    if not budget_s:
        return False
    over = torch.tensor([float(time.perf_counter() - run_start >= budget_s)], device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast(over, src=0)
    return bool(over.item())


def _announce_checkpoint(coordinator: Any, step: int) -> None:
    """Tell the driver, through the coordinator, where Ray Train stored the checkpoint of ``step``:
    it switches ``RUN_DIR/checkpoint`` to it while the run goes on. Rank 0 only."""
    for reported in reversed(ray.train.get_all_reported_checkpoints()):
        if reported.metrics.get("step") == step:
            ray.get(coordinator.checkpoint_saved.remote(step, reported.checkpoint))
            return


def _rewind_prompts(coordinator: Any, step: int, rank: int) -> None:
    """Prompts trained after ``step`` by an earlier worker group of this run (``FailureConfig``
    restart) are served again, since their training was lost with its weights. Rank 0 asks, and
    no rank pulls before it is done (a no-op for a fresh or resumed run)."""
    if rank == 0:
        ray.get(coordinator.rewind.remote(step))
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _restored_critic(state: dict | None, cfg: Config) -> dict:
    """The checkpoint's critic weights; a clear error if it has none (a critic-free run's checkpoint)."""
    if state is None:
        raise ValueError(f"algo.advantage={cfg.algo.advantage} trains a critic, but the checkpoint has none "
                         f"(it was made by a critic-free estimator); resume with that run's algo.advantage")
    return state


def _pull(coordinator: Any, rank: int, n: int, version: int, timeout_s: float, step: int) -> list[ExperienceItem]:
    """``n`` items from the coordinator for ``step``. Items lost with a dead maker are reported
    (their prompts are served again) and replaced.
    The coordinator's errors (maker failure, stall) are re-raised as themselves, so the run's
    error message is the coordinator's one-line diagnosis."""
    items: list[ExperienceItem] = []
    while len(items) < n:
        try:
            chunks = ray.get(coordinator.pull.remote(rank, n - len(items), version, timeout_s, os.getpid(), step))
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        fetched = resolve(chunks)
        if fetched.lost:
            ray.get(coordinator.lost_in_transit.remote(rank, fetched.lost, fetched.lost_prompt_ids))
        items += fetched.items
    return items


@contextlib.contextmanager
def coordinator_death_is_fatal():
    """Turn the death of the coordinator, seen by any call to it, into one clear error.

    Decision (see README, Failure handling): the coordinator holds the experience buffers,
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


class MakerMonitor:
    """Generation throughput and maker idle ratio since the previous step, from the coordinator's totals."""

    def __init__(self, coordinator: Any, engine_gaps: bool = False):
        self.coordinator = coordinator
        self.last = {"tokens": 0.0, "generate_s": 0.0, "idle_s": 0.0}
        self.pending = None
        self.gaps_seen = 0
        self.engine_gaps = engine_gaps  # vLLM makers: relay their log-prob gap (engine_logprob_gap_*)

    def request(self) -> None:
        """Ask for the coordinator's totals now; ``metrics`` reads the answer (no wait on the step's path)."""
        self.pending = self.coordinator.status.remote()

    def metrics(self, step_s: float) -> dict[str, float]:
        status = ray.get(self.pending if self.pending is not None else self.coordinator.status.remote())
        self.pending = None
        makers = status.makers.values()
        totals = {key: sum(getattr(m, key) for m in makers) for key in self.last}
        delta = {key: totals[key] - self.last[key] for key in totals}
        self.last = totals
        n = max(1, len(status.makers))
        counters = status.counters
        return {"generated_tokens_per_s": delta["tokens"] / step_s, "maker_generate_s": delta["generate_s"] / n,
                "maker_idle_ratio": min(1.0, delta["idle_s"] / (n * step_s)),
                "items_produced": float(counters.produced), "items_consumed": float(counters.consumed),
                "items_discarded": float(counters.discarded), "items_in_flight": float(counters.in_flight),
                "items_lost_in_transit": float(counters.lost_in_transit),
                "prompts_trained": float(counters.prompts_trained),
                "prompts_requeued": float(counters.prompts_requeued),
                "prompts_served": float(counters.prompts_served), "prompts_blank": float(counters.blank_prompts),
                "prompts_truncated": float(counters.truncated_prompts), "prompts_lost": float(counters.lost),
                **(self._logprob_gap() if self.engine_gaps else {})}

    def _logprob_gap(self) -> dict[str, float]:
        """engine_logprob_gap_mean / _max over the tokens sampled by vLLM makers since the previous step."""
        gaps = ray.get(self.coordinator.logprob_gaps_since.remote(self.gaps_seen))
        self.gaps_seen += len(gaps)
        tokens = sum(n for _, _, n in gaps)
        if not tokens:
            return {}
        return {"engine_logprob_gap_mean": sum(s for s, _, _ in gaps) / tokens,
                "engine_logprob_gap_max": max(m for _, m, _ in gaps)}


def _verify_makers(coordinator: Any, version: int, expected: str) -> float:
    """1.0 if every maker loaded push ``version`` and holds exactly the published weights."""
    ray.get(coordinator.wait_for_version.remote(version, VERIFY_TIMEOUT_S))
    prints = ray.get(coordinator.maker_fingerprints.remote())
    return float(all(v == version and fp == expected for v, fp in prints.values()))

"""The synchronous PPO loop in one process, no Ray: generate -> score -> advantages -> PPO epochs.

It reuses the pieces of the detached pipeline (``ExperienceMaker``, ``PPOLearner``) and is the
baseline the benchmarks compare the detached pipeline against.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Callable, Iterator, Sequence

import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem, make_kl_controller
from ray_ppo.algo.metrics import experience_metrics
from ray_ppo.config import Config
from ray_ppo.config.preflight import check_local_loop
from ray_ppo.data import DataError, Prompt, PromptEncoder, read_prompt_texts
from ray_ppo.data.seeds import prompt_order, rank_seed
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.makers.dynamic import GroupFilter
from ray_ppo.makers.evaluation import Evaluation
from ray_ppo.models.build import build_actor, build_critic_if_needed, resolve_config
from ray_ppo.outputs.evals import attach_evals, split_evals
from ray_ppo.outputs.samples import SAMPLES_KEY, step_samples
from ray_ppo.tasks.toy import make_prompts
from ray_ppo.train.collectives import broadcast_time_up
from ray_ppo.train.learner import PPOLearner, drop_absent
from ray_ppo.train.strategies import LocalStrategy

MAX_EMPTY_BATCHES = 1000
"""Consecutive prompt batches without a usable prompt before the loop gives up."""


def prompt_batches(prompts: Sequence[Prompt | None], batch_size: int, shuffle: bool, seed: int) -> Iterator[list]:
    """Endless batches of ``batch_size`` prompts in the order the coordinator serves them to makers
    (``ray_ppo.data.seeds.prompt_order``: a new order each epoch with ``shuffle``), the stream
    running on from one epoch into the next."""
    if not prompts:
        raise DataError("the prompt list is empty")
    rows = (int(row) for epoch in itertools.count() for row in prompt_order(len(prompts), seed, epoch, shuffle))
    while True:
        yield [prompts[row] for row in itertools.islice(rows, batch_size)]


def run_local(cfg: Config, prompts: Sequence[Prompt | None] | None = None,
              on_metrics: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``cfg.trainer.total_steps`` synchronous PPO steps, or fewer when ``trainer.time_budget_s``
    runs out; returns the per-step metrics. ``prompts`` (each a ``ray_ppo.data.Prompt``: a text or a
    list of chat messages) default to ``data.path``'s, else the toy task's."""
    check_local_loop(cfg)  # pre-flight's first check; here too for a caller of run_local without it
    cfg = resolve_config(cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    if prompts is None and cfg.data.path:
        prompts = read_prompt_texts(cfg.data.path, cfg.data.prompt_column, cfg.data.format)
    elif prompts is None:
        prompts = make_prompts(cfg.toy.num_prompts, cfg.toy.prompt_len, cfg.toy.seed)
    learner = PPOLearner(build_actor(cfg), build_critic_if_needed(cfg), LocalStrategy(), cfg,
                         seed=rank_seed(cfg.seed, 0))
    maker = build_experience_maker(cfg, actor=learner.actor, critic=learner.critic, name="local",
                                   device=learner.device)
    encoder = PromptEncoder(maker.tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template)
    kl_ctl = make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
    batches = prompt_batches(prompts, cfg.maker.batch_size, cfg.data.shuffle, cfg.seed)
    keep = GroupFilter.of_config(cfg) if cfg.algo.dynamic_sampling else None  # uniform groups dropped, more drawn
    evaluation = Evaluation.of_config(cfg, maker.tokenizer) if cfg.eval.path else None
    reports = [_evaluate(evaluation, learner.actor, 0, 0)] if cfg.eval.due(0, last=False) else []
    history, start = [], time.perf_counter()  # the time budget counts from here, as the detached loop's does
    for step in range(1, cfg.trainer.total_steps + 1):
        step_start = time.perf_counter()
        collect = _stream if cfg.maker.max_running else _collect
        items, generate_s = collect(maker, encoder, batches, cfg.trainer.train_batch_size, step - 1, kl_ctl.value,
                                    keep)
        train_start = time.perf_counter()
        learner.kl_coef = kl_ctl.value
        # The maker shares the learner's actor: it sampled with these very weights (no extra forward pass)
        metrics = drop_absent(learner.train_step(ExperienceBatch.merge(items, maker.tokenizer.pad_token_id),
                                                 version=step - 1, behaviour_is_policy=True))
        metrics.update(experience_metrics(items, step - 1, cfg.ppo.uses_reference))
        if keep is not None:  # as the detached loop's rows: the groups dropped so far, and their share
            metrics.update(prompts_dropped=float(keep.dropped), groups_dropped_share=keep.dropped / (keep.dropped + keep.kept))
        kl_ctl.update(metrics.get("kl", 0.0), len(items))
        step_s = time.perf_counter() - step_start
        metrics.update(step=step, policy_version=step, kl_coef=kl_ctl.value, generate_s=generate_s,
                       train_s=time.perf_counter() - train_start, samples_per_s=len(items) / step_s,
                       elapsed_s=time.perf_counter() - start)
        # the last step: the one at total_steps, or the first to end past the time budget (the detached loop's rule)
        last = step == cfg.trainer.total_steps or broadcast_time_up(cfg.trainer.time_budget_s, start, learner.device)
        if cfg.eval.due(step, last=last):
            reports.append(_evaluate(evaluation, learner.actor, step, step))
        row, reports = attach_evals(metrics, reports), []
        history.append(split_evals(row)[0])
        if on_metrics:
            samples = step_samples(items, maker.tokenizer, step, cfg.logging.samples_every)
            on_metrics({**row, SAMPLES_KEY: samples} if samples else row)
        if last:
            break
    return history


def _evaluate(evaluation: Evaluation, actor: torch.nn.Module, step: int, version: int):
    """The ``eval`` section's evaluation of ``actor`` (the weights of ``step``), as a maker reports it."""
    actor.eval()
    start = time.perf_counter()
    try:
        result = evaluation.run(actor, model="local")
    finally:
        actor.train()
    return result.report(step, version, maker_id=0, eval_s=time.perf_counter() - start)


@contextlib.contextmanager
def _sampling(maker):
    """The maker's models in eval mode while it samples and scores (no LoRA dropout); back in train
    mode after, for the update."""
    models = [model for model in (maker.actor, maker.critic) if model is not None]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model in models:
            model.train()


def _next_encoded(encoder: PromptEncoder, batches: Iterator[list], limit: int | None = None):
    """The next prompt batch (its first ``limit`` prompts) that holds a usable prompt, encoded;
    ``DataError`` after ``MAX_EMPTY_BATCHES`` blank batches in a row."""
    for _ in range(MAX_EMPTY_BATCHES + 1):
        encoded = encoder.encode(next(batches)[:limit])
        if encoded.ids:
            return encoded
    raise DataError(f"no usable prompt in {MAX_EMPTY_BATCHES} batches: every prompt is blank")


def _collect(maker, encoder: PromptEncoder, batches: Iterator[list], n: int, version: int,
             kl_coef: float, keep: GroupFilter | None = None) -> tuple[list[ExperienceItem], float]:
    """Generate until ``n`` items are made (a surplus is dropped; ``n`` and every batch hold whole
    groups, so no group is cut), the groups ``keep`` drops (``algo.dynamic_sampling``) not
    counted; returns items and generation seconds."""
    items: list[ExperienceItem] = []
    start = time.perf_counter()
    with _sampling(maker):
        while len(items) < n:
            encoded = _next_encoded(encoder, batches)
            made = maker.make_experience(encoded.ids, version, kl_coef, encoded.prompts)[0]
            items.extend(made if keep is None else keep(made)[0])
    return items[:n], time.perf_counter() - start


def _stream(maker, encoder: PromptEncoder, batches: Iterator[list], n: int, version: int,
            kl_coef: float, keep: GroupFilter | None = None) -> tuple[list[ExperienceItem], float]:
    """``_collect`` through a ``ContinuousBatcher`` (``maker.max_running`` > 0), as a streaming maker
    generates: the groups of ``n // samples_per_prompt`` prompts queue at once, a slot freed by a
    short answer takes the next sequence, and each group is made into experience as it finishes
    (and, where ``keep`` drops groups, more prompts queue until ``n`` items are kept). Nothing runs
    across steps (the weights change in between), so every token is this version's."""
    from ray_ppo.models.continuous import ContinuousBatcher

    m = maker.sampling
    batcher = ContinuousBatcher(maker.actor, m, maker.tokenizer.pad_token_id, maker.stop_ids,
                                max_running=m.max_running, kv_at_swap=m.kv_at_swap, version=version,
                                schedule="fifo")  # no answer of a prompt is known before its first epoch ends
    items: list[ExperienceItem] = []
    start = time.perf_counter()
    with _sampling(maker):
        while len(items) < n:
            items += _stream_groups(maker, encoder, batches, batcher, (n - len(items)) // m.samples_per_prompt,
                                    kl_coef, keep)
    return items, time.perf_counter() - start


def _stream_groups(maker, encoder: PromptEncoder, batches: Iterator[list], batcher, groups: int, kl_coef: float,
                   keep: GroupFilter | None) -> list[ExperienceItem]:
    """The items of ``groups`` prompts' groups streamed through ``batcher`` (episodes turn by turn
    with an environment), less those ``keep`` drops."""
    from ray_ppo.models.continuous import Request

    m, ids, prompts = maker.sampling, [], []
    while len(ids) < groups:
        encoded = _next_encoded(encoder, batches, groups - len(ids))
        ids += encoded.ids
        prompts += encoded.prompts
    n = m.samples_per_prompt
    if maker.episodes is not None:  # each sample an episode; they come back in order, groups together
        episodes = maker.episodes.stream(m.max_new_tokens).run(
            batcher, [i for i in ids for _ in range(n)], [p for p in prompts for _ in range(n)])
        made = maker.experience_of(episodes, kl_coef, [e.prompt for e in episodes])[0]
        return made if keep is None else keep(made)[0]
    batcher.submit(Request((k, s, prompts[k]), prompt) for k, prompt in enumerate(ids) for s in range(n))
    finished: dict[int, list] = {}
    items = []
    while batcher.busy:
        for f in batcher.step():
            finished.setdefault(f.key[0], []).append(f)
            if len(finished[f.key[0]]) == n:
                group = sorted(finished.pop(f.key[0]), key=lambda f: f.key[1])
                made = maker.experience_of(group, kl_coef, [f.key[2] for f in group])[0]
                items += made if keep is None else keep(made)[0]
    return items

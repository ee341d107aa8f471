"""Making experience: generate -> score -> log-probs (and values) -> KL-penalised rewards -> advantages.

Advantages come from ``algo.advantage``: GAE with the critic's values, or a critic-free estimator
(GRPO, RLOO, REINFORCE++: ``ray_ppo.algo.estimators``); with ``maker.samples_per_prompt`` = n
each prompt is sampled n times and its n items sit next to each other (a group).

``ExperienceMaker`` is a plain class. The synchronous local loop calls it directly; the maker
actor (``ray_ppo.makers.worker``) wraps it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ray_ppo.algo import (
    ExperienceBatch,
    ExperienceItem,
    compute_advantages,
    compute_kl,
    kl_penalized_rewards,
    overlong_penalty,
)
from ray_ppo.config import Config
from ray_ppo.models import (
    RewardFn,
    Rollout,
    action_log_probs,
    action_values,
    generate,
    model_device,
    stop_token_ids,
)
from ray_ppo.models.continuous import Finished, rollout_of


class RewardError(ValueError):
    """A reward function or model gave something other than one finite score per response; the message
    names the reward and the offending prompt."""


def reward_problem(scores, expected: int) -> tuple[str, int | None] | None:
    """What is wrong with a reward's answer and the index of the offending response, or None if it
    is one finite real number (or 0-d tensor) per response."""
    try:
        values = list(scores)
    except TypeError:
        return f"returned {type(scores).__name__}, not a list of floats", None
    if len(values) != expected:
        return f"returned {len(values)} scores for {expected} responses", None
    for i, v in enumerate(values):
        is_number = isinstance(v, numbers.Real) or getattr(v, "ndim", None) == 0
        if isinstance(v, bool) or not is_number:
            return f"returned {v!r} ({type(v).__name__}), not a number,", i
        if not math.isfinite(float(v)):
            return f"returned {float(v)}", i
    return None


def reward_name(fn) -> str:
    """``module:function`` of a rule reward, as ``model.reward_fn`` spells it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclass
class MakeStats:
    """Timings and counts of one ``make_experience`` call."""

    num_samples: int = 0
    num_tokens: int = 0
    generate_s: float = 0.0
    score_s: float = 0.0
    logprob_gap: tuple[float, float, int] | None = None
    """With an engine: (sum, max, count) of |engine - HF| log-probs over the sampled tokens."""
    faults: list[str] = dataclasses.field(default_factory=list)
    """Multi-turn episodes that an environment fault ended: what went wrong, with the prompt."""
    utilisation: float | None = None
    """Multi-turn episodes: the share of their wall time that generation was busy."""


class ExperienceMaker:
    """Turns prompt token ids into per-sample ``ExperienceItem``s.

    Responsibilities:
      - sample responses from the actor;
      - score them with the reward model or the rule reward;
      - compute behaviour and reference log-probs and, for GAE, critic values;
      - shape per-token rewards with the KL penalty and compute advantages and returns.

    The settings are the run's ``Config``: ``cfg.maker`` samples (it is a ``SamplingParams``) and
    sets the group size, ``ppo.*`` and ``algo.*`` shape the rewards and advantages. The KL
    coefficient is an argument of ``make_experience`` (the trainer's KL controller owns it).

    ``reference=False`` (``ppo.uses_reference`` false: no KL term) computes no reference log-probs;
    the items carry the behaviour log-probs in their place, a KL of 0 that nothing reads.

    ``critic`` is None for the critic-free estimators. ``ref`` may be None when the actor is a peft
    model: the reference is then the actor with its adapters disabled, and stays so if a peft
    ``ref`` is set later (a quantized maker generates with a merged copy and keeps the float peft
    model as reference).

    The rollout runs on the actor's device (every model must be on it): prompts are padded and
    moved there, generated, scored and shaped there, and the items come back on the CPU, ready
    for the wire.

    A response ends at its first end token (``stop_token_ids``: the tokenizer's EOS, the actor's
    generation-config end ids, the pad) or at ``maker.max_new_tokens``: then it is truncated
    (``ExperienceItem.truncated``, which ``algo.overlong_filter`` masks out of the loss). With
    ``algo.overlong_buffer`` a response that nears the limit has its score lowered before the
    advantages (DAPO's soft overlong punishment, ``ray_ppo.algo.overlong``); the item's
    ``reward`` stays the score.

    ``episodes`` (optional, an ``ray_ppo.makers.episodes.EpisodeRunner``, ``env.cls``): each sample is
    a multi-turn episode with an environment, whose turns' rewards are the score (the reward
    function and model are not used for experience). Only the policy's tokens are trained; an
    episode that an environment fault ended is kept, so its group stays whole, but carries no
    advantage: it neither rewards nor punishes the policy for the environment's failure (its
    score counts as its group's mean in the group's statistics).

    ``engine`` (optional, e.g. ``ray_ppo.makers.vllm_engine.VllmEngine``) samples instead of HF
    ``generate``: ``engine.generate(prompts, sampling, pad_token_id, stop_ids) -> Rollout``
    with the engine's own ``log_probs``. The behaviour log-probs are still recomputed with
    ``actor`` unless ``engine_logprobs``; either way ``MakeStats.logprob_gap`` compares the two.
    Without an engine, ``engine_logprobs`` reads the behaviour log-probs from HF ``generate``'s own
    logits (the same numbers as a forward pass, up to float rounding) and skips that pass.
    """

    def __init__(self, actor: nn.Module, ref: nn.Module | None, critic: nn.Module | None, tokenizer,
                 cfg: Config, reward_fn: RewardFn | None = None, reward_model: nn.Module | None = None,
                 name: str = "maker", engine=None, engine_logprobs: bool = False, episodes=None,
                 reference: bool = True):
        if (reward_fn is None) == (reward_model is None):
            raise ValueError("give exactly one of reward_fn and reward_model")
        estimator = cfg.algo.advantage
        if (critic is None) == (estimator == "gae"):
            raise ValueError(f"advantage estimator {estimator!r} needs {'a critic' if estimator == 'gae' else 'no critic'}")
        self.actor, self.ref, self.critic, self.tokenizer = actor, ref, critic, tokenizer
        self.sampling, self.ppo, self.algo = cfg.maker, cfg.ppo, cfg.algo
        self.group_size = cfg.maker.samples_per_prompt
        self.reward_fn, self.reward_model = reward_fn, reward_model
        self.name = name
        self.ref_disable_adapters = ref is None
        self.reference = reference
        self.engine, self.engine_logprobs = engine, engine_logprobs
        self.episodes = episodes
        self.stop_ids = stop_token_ids(tokenizer, actor)
        self._counter = 0

    @torch.no_grad()
    def make_experience(self, prompt_ids: Sequence[Sequence[int]], policy_version: int,
                        kl_coef: float | None = None,
                        prompts: Sequence[str | list[dict]] | None = None) -> tuple[list[ExperienceItem], MakeStats]:
        """One batch of experience from token-id prompts, every item tagged with ``policy_version``:
        ``samples_per_prompt`` items per prompt, each prompt's items next to each other. Rewards
        are shaped with ``kl_coef``, the trainer's current coefficient (its KL controller owns it:
        ``ray_ppo.wire.messages``); None means the initial ``ppo.kl_coef``. ``prompts``: each
        prompt as the data gave it (``ray_ppo.data.Prompt``), which the reward function
        receives and each item carries (``ExperienceItem.prompt``); None: the reward function
        receives the decoded ``prompt_ids``."""
        n = self.group_size
        prompt_ids = [p for p in prompt_ids for _ in range(n)]
        given = None if prompts is None else [p for p in prompts for _ in range(n)]
        stats = MakeStats(num_samples=len(prompt_ids))
        start = time.perf_counter()
        if self.episodes is not None:
            rollout, reward, token_scores, faulted, counts = self._run_episodes(prompt_ids, given, stats)
        else:
            rollout, token_scores, faulted, counts = self._sample(prompt_ids), None, None, None
            stats.generate_s = time.perf_counter() - start
        start = time.perf_counter()
        if self.episodes is None:  # an episode's score is its environment's rewards
            reward = self._score(rollout, given)
        kl_coef = self.ppo.kl_coef if kl_coef is None else kl_coef
        batch = self._to_batch(rollout, reward, policy_version, kl_coef, stats, token_scores, faulted).to("cpu")
        stats.score_s = time.perf_counter() - start
        stats.num_tokens = int(rollout.action_mask.sum())
        return self._items(batch, given, counts), stats

    @torch.no_grad()
    def experience_of(self, finished: Sequence[Finished], kl_coef: float | None = None,
                      prompts: Sequence[str | list[dict]] | None = None) -> tuple[list[ExperienceItem], MakeStats]:
        """Experience from sequences a ``ContinuousBatcher`` finished (or, with an environment, whole
        episodes streamed through it: ``EpisodeRunner.open``): whole groups, each group's
        ``samples_per_prompt`` sequences next to each other. Scored, shaped and with advantages as
        ``make_experience`` makes them, except that the behaviour log-probs are always the
        sampler's own, token by token (weights may have changed during a sequence, so no forward
        pass now could give them), and each item's ``policy_version`` is the oldest token's of its
        group (a group travels in one chunk, of one version; the item's ``version_runs`` give
        every token's own, where they differ from it).

        Args:
            finished: the sequences (``Finished``; with an environment, finished ``Episode``), group by group.
            kl_coef: the trainer's KL coefficient (None: ``ppo.kl_coef``).
            prompts: each sequence's prompt as the data gave it (None: the decoded prompt ids).

        Returns:
            The items (one per sequence, in order, on the CPU) and the stats (``generate_s`` is 0:
            the batcher's time is the caller's to count).
        """
        if len(finished) % self.group_size:
            raise ValueError(f"{len(finished)} sequences do not make whole groups of {self.group_size}")
        stats = MakeStats(num_samples=len(finished))
        start = time.perf_counter()
        token_scores = faulted = counts = None
        if self.episodes is not None:  # whole episodes (ray_ppo.makers.episodes.Episode), streamed turn by turn
            run = self.episodes.streamed(list(finished))
            rollout, token_scores, faulted = run.rollout, run.token_scores, run.faulted
            versions = torch.tensor([min(e.versions) for e in finished], dtype=torch.long)
            counts = [e.counts() for e in finished]
            stats.faults = [e.fault for e in finished if e.fault is not None]
        else:
            rollout, versions = rollout_of(finished, self.tokenizer.pad_token_id)
        # A group travels, and is counted for staleness, as one: at its oldest sequence's version.
        versions = versions.view(-1, self.group_size).min(dim=1).values.repeat_interleave(self.group_size)
        rollout = self._on_device(rollout)
        if token_scores is not None:  # an episode's score is its environment's rewards
            token_scores, faulted = token_scores.to(self.device), faulted.to(self.device)
            reward = token_scores.sum(dim=1)
        else:
            reward = self._score(rollout, None if prompts is None else list(prompts))
        kl_coef = self.ppo.kl_coef if kl_coef is None else kl_coef
        batch = self._to_batch(rollout, reward, versions.to(self.device), kl_coef, stats, token_scores, faulted,
                               sampled=True).to("cpu")
        stats.score_s = time.perf_counter() - start
        stats.num_tokens = int(rollout.action_mask.sum())
        items = self._items(batch, prompts, counts)
        for item, f in zip(items, finished, strict=True):
            runs = f.version_runs
            item.version_runs = tuple(runs) if len(runs) > 1 else None  # one run: policy_version says it all
        return items, stats

    def _items(self, batch: ExperienceBatch, prompts: Sequence | None, counts: list | None = None) -> list[ExperienceItem]:
        """``batch`` as items, each with a uid unique to this maker, its prompt and its episode's counts."""
        items = batch.split()
        for i, item in enumerate(items):
            item.uid = f"{self.name}-{self._counter}-{i}"
            item.prompt = None if prompts is None else prompts[i]
            item.episode = None if counts is None else counts[i]
        self._counter += 1
        return items

    def _sample(self, prompt_ids: list, max_new_tokens: int | None = None) -> Rollout:
        """One response per prompt, with the engine or HF ``generate``, on the actor's device."""
        sampling = self.sampling if max_new_tokens is None else \
            self.sampling.model_copy(update=dict(max_new_tokens=min(max_new_tokens, self.sampling.max_new_tokens)))
        sampler = self.engine.generate if self.engine is not None else \
            functools.partial(generate, self.actor, log_probs=self.engine_logprobs)
        return self._on_device(sampler(prompt_ids, sampling, self.tokenizer.pad_token_id, self.stop_ids))

    def _on_device(self, rollout: Rollout) -> Rollout:
        """``rollout`` with its tensors on the actor's device."""
        if rollout.sequences.device == self.device:
            return rollout
        return Rollout(*(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in dataclasses.astuple(rollout)))

    def _turns(self, contexts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], bool]]:
        """One policy turn per context (``ray_ppo.makers.episodes.Sample``)."""
        return self._sample(contexts, max_new_tokens).responses(self.stop_ids)

    def _run_episodes(self, prompt_ids: list, given: list | None, stats: MakeStats):
        """(rollout, score, token scores, faulted, counts) of one episode per prompt id."""
        prompts = given if given is not None else self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        run = self.episodes.run(prompt_ids, prompts, self._turns)
        stats.generate_s, stats.utilisation = run.generate_s, run.utilisation
        stats.faults = [e.fault for e in run.episodes if e.fault is not None]
        rollout = self._on_device(run.rollout)
        scores, faulted = run.token_scores.to(self.device), run.faulted.to(self.device)
        return rollout, scores.sum(dim=1), scores, faulted, [e.counts() for e in run.episodes]

    @property
    def device(self) -> torch.device:
        """Where rollouts are generated and scored: the actor's device."""
        return model_device(self.actor)

    def _score(self, rollout: Rollout, prompts: list | None) -> torch.Tensor:
        """One float32 score per sample (B,), on the rollout's device. A rule reward receives
        ``prompts`` (each sample's prompt as the data gave it; without them, the decoded prompts)
        and the decoded responses."""
        if self.reward_model is not None:
            scores = self.reward_model(rollout.sequences, rollout.attention_mask).float()
            bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
            if bad:
                prompts, responses = self._decode(rollout, prompts)
                self._reward_fault(f"the reward model (model.reward_pretrained) returned {scores[bad[0]].item()}",
                                   bad[0], prompts, responses)
            return scores
        prompts, responses = self._decode(rollout, prompts)
        scores = self.reward_fn(prompts, responses)
        problem = reward_problem(scores, len(responses))
        if problem:
            self._reward_fault(f"model.reward_fn={reward_name(self.reward_fn)!r} {problem[0]}", problem[1], prompts,
                               responses)
        return torch.tensor([float(s) for s in scores], dtype=torch.float32, device=rollout.sequences.device)

    def _decode(self, rollout: Rollout, prompts: list | None) -> tuple[list, list[str]]:
        """(``prompts``, or the decoded prompts without them; the decoded responses)."""
        sequences = rollout.sequences.cpu()  # decoding reads token ids one by one
        responses = self.tokenizer.batch_decode(sequences[:, rollout.prompt_len:], skip_special_tokens=True)
        if prompts is None:
            prompts = self.tokenizer.batch_decode(sequences[:, :rollout.prompt_len], skip_special_tokens=True)
        return prompts, responses

    def _reward_fault(self, problem: str, index: int | None, prompts: list, responses: list[str]) -> None:
        where = (f"for prompt {prompts[index]!r} (response {responses[index]!r})" if index is not None
                 else f"for a batch of {len(prompts)} prompts (the first {prompts[0]!r})")
        raise RewardError(f"{problem} {where} in {self.name}; a reward must be one finite float per response")

    def _neutral(self, reward: torch.Tensor, token_scores: torch.Tensor, mask: torch.Tensor,
                 faulted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores of the faulted episodes replaced by the mean of their group's others (0 if none),
        placed at their last token: they then shift no group baseline."""
        groups, bad = reward.reshape(-1, self.group_size), faulted.reshape(-1, self.group_size)
        good = (~bad).float()
        mean = (groups * good).sum(dim=1, keepdim=True) / good.sum(dim=1, keepdim=True).clamp(min=1)
        reward = torch.where(bad, mean, groups).reshape(-1)
        placed = kl_penalized_rewards(reward, torch.zeros_like(token_scores), mask, 0.0)  # each score at its last token
        return reward, torch.where(faulted.unsqueeze(1), placed, token_scores)

    def _ref_log_probs(self, rollout: Rollout) -> torch.Tensor:
        args = (rollout.sequences, rollout.attention_mask, rollout.num_actions, self.sampling.temperature)
        model = self.ref if self.ref is not None else self.actor
        if not self.ref_disable_adapters:
            return action_log_probs(model, *args)
        with model.disable_adapter():
            return action_log_probs(model, *args)

    def _behaviour_log_probs(self, rollout: Rollout, stats: MakeStats, sampled: bool = False) -> torch.Tensor:
        """(B, R) log-probs of the sampled tokens under the policy that sampled them: HF ``generate``'s
        own with ``engine_logprobs`` (or ``sampled``: the only ones there are), else a forward pass of
        the actor (an engine's own are then compared with it in ``stats.logprob_gap``, and used with
        ``engine_logprobs``)."""
        if sampled or self.engine is None and self.engine_logprobs and rollout.log_probs is not None:
            return rollout.log_probs
        log_probs = action_log_probs(self.actor, rollout.sequences, rollout.attention_mask, rollout.num_actions,
                                     self.sampling.temperature)
        if rollout.log_probs is not None:
            gap = (rollout.log_probs - log_probs).abs()[rollout.action_mask]
            stats.logprob_gap = (float(gap.sum()), float(gap.max()) if gap.numel() else 0.0, int(gap.numel()))
            if self.engine_logprobs:
                log_probs = rollout.log_probs
        return log_probs

    def _to_batch(self, rollout: Rollout, reward: torch.Tensor, policy_version: int | torch.Tensor, kl_coef: float,
                  stats: MakeStats, token_scores: torch.Tensor | None = None,
                  faulted: torch.Tensor | None = None, sampled: bool = False) -> ExperienceBatch:
        mask = rollout.action_mask
        if faulted is not None and bool(faulted.any()):
            reward, token_scores = self._neutral(reward, token_scores, mask, faulted)
        log_probs = self._behaviour_log_probs(rollout, stats, sampled)
        ref_log_probs = self._ref_log_probs(rollout) if self.reference else log_probs  # no reference: no KL
        values = torch.zeros_like(log_probs) if self.critic is None else \
            action_values(self.critic, rollout.sequences, rollout.attention_mask, rollout.num_actions) * mask
        p, a = self.ppo, self.algo
        kl = compute_kl(log_probs, ref_log_probs, p.kl_estimator) * mask
        shaped = reward  # algo.overlong_buffer is for single completions (the config refuses it with episodes)
        if a.overlong_buffer:
            shaped = reward + overlong_penalty(mask.sum(dim=1), self.sampling.max_new_tokens, a.overlong_buffer,
                                               a.overlong_penalty)
        rewards, advantages, returns = compute_advantages(
            a.advantage, shaped, kl, values, mask, kl_coef=kl_coef, kl_in=p.kl_in, gamma=p.gamma,
            lam=p.lam, group_size=self.group_size, group_norm_std=a.group_norm_std, token_scores=token_scores)
        if faulted is not None and bool(faulted.any()):  # no advantage, and the critic's target is its own value
            rows = faulted.unsqueeze(1)
            advantages = torch.where(rows, 0.0, advantages)
            returns = torch.where(rows, values if self.critic is not None else 0.0, returns)
        return ExperienceBatch(
            sequences=rollout.sequences, attention_mask=rollout.attention_mask, action_mask=mask,
            action_log_probs=log_probs * mask, ref_log_probs=ref_log_probs * mask, values=values, rewards=rewards,
            advantages=advantages, returns=returns, reward=reward,
            policy_version=policy_version if isinstance(policy_version, torch.Tensor) else
            torch.full((len(reward),), policy_version, dtype=torch.long, device=reward.device),
            uids=[""] * len(reward), prompt_len=rollout.prompt_len, pad_token_id=self.tokenizer.pad_token_id,
            truncated=None if self.episodes is not None else self._truncated(rollout),
        )

    def _truncated(self, rollout: Rollout) -> torch.Tensor:
        """(B,) bool: the responses that end on no end token (cut at ``maker.max_new_tokens``), as
        ``Rollout.responses`` tells each row's stop."""
        stopped = [stop for _, stop in rollout.responses(self.stop_ids)]
        return ~torch.tensor(stopped, dtype=torch.bool, device=rollout.action_mask.device)

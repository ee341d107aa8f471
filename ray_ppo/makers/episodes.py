"""Multi-turn episodes: a maker's policy and an environment (``ray_ppo.env``) take turns.

    runner = EpisodeRunner(env_cls, cfg.env, tokenizer, chat_template=cfg.data.chat_template)
    episodes = runner.run(prompt_ids, prompts, sample)   # sample(contexts, max_new_tokens) -> new tokens

An episode's response is every token after its prompt: the policy's turns and, between them, the
environment's observations, rendered as the tokenizer's chat template renders the next message
(a text prompt's observations are appended as they are; one whose text the tokenizer cannot spell,
``lost_text``, is counted in ``Episode.lost_text`` and warned about once per runner).
``Episodes.rollout.action_mask`` marks the policy's tokens, which alone are trained; each turn's
reward sits at the last token of that turn (``token_scores``).

Streaming makers (``maker.max_running``) run episodes through their continuous batcher instead
(``open``, ``turn``, ``answer``, ``streamed``): each policy turn is one request, the next turn's
request is submitted as soon as the environment answers, and each token keeps its sampler's
log-prob and version, so a push may land between two turns or inside one.

In a batch, scheduling keeps generation busy while environments think: the episodes are cut into
``env.pipeline`` groups; a group generates its next turn while the steps of the others run on an
event loop in a thread of their own, and any episode whose environment has answered joins the next
generation call. A step that raises, outlasts ``env.step_timeout_s`` or returns something other
than a ``Turn`` ends its episode as a fault (``Episode.fault``), not the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import threading
import time
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ray_ppo.config import EnvConfig
from ray_ppo.data import Prompt
from ray_ppo.env import EnvError, Turn, take_step
from ray_ppo.models.continuous import Request, version_runs
from ray_ppo.models.generation import Rollout, left_pad

Sample = Callable[[list[list[int]], int], list[tuple[list[int], bool]]]
"""sample(contexts, max_new_tokens) -> for each context, (the policy's new tokens, whether they end on
a stop token): what ``Rollout.responses`` gives of a generated rollout."""

logger = logging.getLogger(__name__)

_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@dataclass
class Episode:
    """One episode as it runs: the prompt, then the response built turn by turn."""

    prompt: Prompt
    prompt_ids: list[int]
    chat: bool
    env: object = None
    tokens: list[int] = field(default_factory=list)
    """The response so far: the policy's and the environment's tokens."""
    actions: list[bool] = field(default_factory=list)
    """Per response token: the policy generated it."""
    scores: list[float] = field(default_factory=list)
    """Per response token: the reward of the turn that ends there, else 0."""
    turns: int = 0
    info: dict = field(default_factory=dict)
    fault: str | None = None
    done: bool = False
    stopped: bool = False
    """The policy's last turn ended on a stop token."""
    lost_text: int = 0
    """Observations put in the context whose text the tokenizer cannot spell (``lost_text``)."""
    key: tuple | None = None
    """A streaming maker's key of this episode (``EpisodeRunner.open``); None in a batch."""
    log_probs: list[float] = field(default_factory=list)
    """Streamed: per response token, the sampler's log-prob of a policy token (0 on the environment's)."""
    versions: list[int] = field(default_factory=list)
    """Streamed: per response token, the policy version that sampled it (an observation takes its
    turn's last)."""

    @property
    def reward(self) -> float:
        return sum(self.scores)

    @property
    def version_runs(self) -> list[tuple[int, int]]:
        """Streamed: the response tokens' versions as runs, ``[(version, count), ...]``."""
        return version_runs(self.versions)

    def counts(self) -> dict:
        """What ``ExperienceItem.episode`` carries: turns, fault (0 or 1), lost_text where not 0, the
        environment's counts, and for a faulted episode what went wrong (``problem``, shown by
        ``ray_ppo.outputs.samples.pick_faults``)."""
        counts = {"turns": float(self.turns), "fault": float(self.fault is not None),
                  **({"lost_text": float(self.lost_text)} if self.lost_text else {}), **self.info}
        return counts if self.fault is None else {**counts, "problem": self.fault}


@dataclass
class Episodes:
    """A batch of finished episodes, padded: ``rollout`` (prompts left-, responses right-padded;
    ``action_mask`` True on the policy's tokens) and the (B, R) ``token_scores``."""

    episodes: list[Episode]
    rollout: Rollout
    token_scores: torch.Tensor
    generate_s: float
    """Seconds spent in ``sample`` (generation)."""
    wall_s: float

    @property
    def faulted(self) -> torch.Tensor:
        return torch.tensor([e.fault is not None for e in self.episodes])

    @property
    def utilisation(self) -> float:
        """The share of the episodes' wall time that generation was busy."""
        return self.generate_s / self.wall_s if self.wall_s > 0 else 0.0


def lost_text(tokenizer, observation: str | list[dict]) -> tuple[str, str] | None:
    """(the text, what its tokens decode to) of the first text of ``observation`` (itself, or a
    message's content) that the tokenizer cannot spell: decoding its tokens does not give it back,
    whitespace and Unicode compatibility forms aside (a word outside a word-level vocabulary becomes
    ``<unk>``; a BPE without byte fallback drops characters it has no token for). None if none."""
    texts = [observation] if isinstance(observation, str) else [m["content"] for m in observation]
    for text in texts:
        if not isinstance(text, str):
            continue
        decoded = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"])
        if _spelling(decoded) != _spelling(text):
            return text, decoded
    return None


def _spelling(text: str) -> str:
    """What a round trip through a tokenizer must keep of ``text``: its characters, NFKC-normalised,
    without whitespace (tokenizers split on it, and their decoders rejoin it their own way)."""
    return "".join(unicodedata.normalize("NFKC", text).split())


class EpisodeRunner:
    """Runs episodes of ``env_cls`` for a maker.

    Responsibilities: keep generation fed while environment steps run (``env.pipeline`` groups),
    turn observations into tokens with the tokenizer's chat template, count those it cannot spell,
    bound each episode (``env.max_turns``, ``env.max_tokens``, ``env.step_timeout_s``) and end a
    faulty one alone."""

    def __init__(self, env_cls: type, cfg: EnvConfig, tokenizer, chat_template: bool = False):
        self.env_cls, self.cfg, self.tokenizer, self.chat_template = env_cls, cfg, tokenizer, chat_template
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="ray_ppo-env"))
        threading.Thread(target=self.loop.run_forever, name="ray_ppo-env-loop", daemon=True).start()
        self.warned_lost_text = False

    def run(self, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Prompt], sample: Sample) -> Episodes:
        """Run one episode per prompt to its end; ``prompts`` as the data gave them."""
        start = time.perf_counter()
        episodes = [Episode(prompt, self._with_tools(list(ids), prompt), self._is_chat(prompt))
                    for ids, prompt in zip(prompt_ids, prompts, strict=True)]
        ready, waiting = deque(episodes), {}
        group = max(1, math.ceil(len(episodes) / self.cfg.pipeline))
        generate_s = 0.0
        while ready or waiting:
            if ready:
                batch = [ready.popleft() for _ in range(min(group, len(ready)))]
                budget = min(self.cfg.max_tokens - len(e.tokens) for e in batch)  # an engine's contexts have a hard limit
                t0 = time.perf_counter()
                outs = sample([e.prompt_ids + e.tokens for e in batch], budget)
                generate_s += time.perf_counter() - t0
                for episode, (new, stopped) in zip(batch, outs, strict=True):
                    text = self._policy_turn(episode, new, stopped)
                    waiting[asyncio.run_coroutine_threadsafe(self._step(episode, text), self.loop)] = episode
            answered = [f for f in waiting if f.done()]
            if not ready and not answered:
                concurrent.futures.wait(list(waiting), return_when=concurrent.futures.FIRST_COMPLETED)
                answered = [f for f in waiting if f.done()]
            for future in answered:
                episode = waiting.pop(future)
                self._answer(episode, future)
                if not episode.done:
                    ready.append(episode)
        rollout, scores = self._pad(episodes)
        return Episodes(episodes, rollout, scores, generate_s, time.perf_counter() - start)

    def stream(self, max_new_tokens: int) -> EpisodeStream:
        """This runner's episodes streamed through a continuous batcher (``EpisodeStream``)."""
        return EpisodeStream(self, max_new_tokens)

    def open(self, prompt_ids: Sequence[int], prompt: Prompt, key: tuple) -> Episode:
        """A streamed episode (a streaming maker's), named ``key``; its first turn's context is
        ``context(episode)``."""
        return Episode(prompt, self._with_tools(list(prompt_ids), prompt), self._is_chat(prompt), key=key)

    @staticmethod
    def context(episode: Episode) -> list[int]:
        """What the policy's next turn continues: the prompt and the response so far."""
        return episode.prompt_ids + episode.tokens

    def room(self, episode: Episode) -> int:
        """Tokens the episode's budget (``env.max_tokens``) leaves for the policy's next turn."""
        return self.cfg.max_tokens - len(episode.tokens)

    def turn(self, episode: Episode, tokens: Sequence[int], log_probs: Sequence[float], versions: Sequence[int],
             stopped: bool) -> concurrent.futures.Future:
        """Append a streamed policy turn (its tokens, each one's sampler log-prob and version) and
        start the environment's step on it; ``answer`` takes the returned future once done."""
        before = len(episode.tokens)
        text = self._policy_turn(episode, list(tokens), stopped)
        kept = len(episode.tokens) - before
        episode.log_probs += list(log_probs[:kept])
        episode.versions += list(versions[:kept])
        return asyncio.run_coroutine_threadsafe(self._step(episode, text), self.loop)

    def answer(self, episode: Episode, future: concurrent.futures.Future) -> None:
        """Take the environment's answer to a streamed turn (``_answer``); its observation tokens
        get log-prob 0 and the turn's version. The episode is then ``done``, or ready for its next turn."""
        before = len(episode.tokens)
        self._answer(episode, future)
        added = len(episode.tokens) - before
        episode.log_probs += [0.0] * added
        episode.versions += [episode.versions[-1] if episode.versions else 0] * added

    def streamed(self, episodes: list[Episode]) -> Episodes:
        """Finished streamed episodes as a batch's ``Episodes``, with the sampler's log-probs
        (``rollout.log_probs``, 0 on the environment's tokens)."""
        rollout, scores = self._pad(episodes)
        log_probs = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        for row, e in enumerate(episodes):
            log_probs[row, :len(e.log_probs)] = torch.tensor(e.log_probs, dtype=torch.float32)
        rollout.log_probs = log_probs * rollout.action_mask
        return Episodes(episodes, rollout, scores, generate_s=0.0, wall_s=0.0)

    def _is_chat(self, prompt: Prompt) -> bool:
        return isinstance(prompt, list) or self.chat_template

    def _with_tools(self, ids: list[int], prompt: Prompt) -> list[int]:
        """A chat prompt rendered with the environment's ``tools`` where the chat template renders
        tools (``apply_chat_template(..., tools=...)``); else ``ids`` as encoded."""
        tools = getattr(self.env_cls, "tools", None)
        if not tools or not self._is_chat(prompt):
            return ids
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        plain = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        if with_tools == plain:
            return ids
        return self.tokenizer(with_tools, add_special_tokens=False)["input_ids"]

    def _policy_turn(self, episode: Episode, new: list[int], stopped: bool) -> str:
        """Append the policy's turn (cut to the episode's token budget); its decoded text."""
        room = self.cfg.max_tokens - len(episode.tokens)
        if len(new) > room:
            new, stopped = new[:room], False
        episode.tokens += new
        episode.actions += [True] * len(new)
        episode.scores += [0.0] * len(new)
        episode.turns += 1
        episode.stopped = stopped
        return self.tokenizer.decode(new, skip_special_tokens=True)

    async def _step(self, episode: Episode, response: str) -> Turn:
        if episode.env is None:  # built here, so a constructor that raises is a fault of its episode
            episode.env = self.env_cls(episode.prompt)
        return await take_step(episode.env, response, self.cfg.step_timeout_s)

    def _answer(self, episode: Episode, future: concurrent.futures.Future) -> None:
        """Take the environment's answer: the turn's reward, then the observation unless the episode ends."""
        try:
            turn = future.result()
        except TimeoutError:
            return self._fault(episode, f"step took longer than env.step_timeout_s={self.cfg.step_timeout_s:g} s")
        except EnvError as e:
            return self._fault(episode, str(e))
        except Exception as e:  # the environment's own error ends its episode, not the run
            return self._fault(episode, f"step raised {type(e).__name__}: {e}")
        episode.scores[-1] += float(turn.reward)
        for key, value in turn.info.items():
            episode.info[key] = episode.info.get(key, 0.0) + float(value)
        if turn.done or episode.turns >= self.cfg.max_turns or turn.observation is None:
            episode.done = True
            return
        observation = self.observation_ids(turn.observation, episode.chat, episode.stopped)
        if len(episode.tokens) + len(observation) >= self.cfg.max_tokens:  # no room for the policy's next turn
            episode.done = True
            return
        episode.tokens += observation
        episode.actions += [False] * len(observation)
        episode.scores += [0.0] * len(observation)
        self._check_spelling(turn.observation, episode)

    def _check_spelling(self, observation: str | list[dict], episode: Episode) -> None:
        """Count an observation the tokenizer cannot spell in its episode; warn at the first."""
        lost = lost_text(self.tokenizer, observation)
        if lost is None:
            return
        episode.lost_text += 1
        if not self.warned_lost_text:
            self.warned_lost_text = True
            logger.warning("env.cls=%s: the tokenizer cannot spell the observation %.80r (its tokens decode as "
                           "%.80r), so the policy sees it garbled; counted in env/lost_text, this warning is not "
                           "repeated. Write observations the tokenizer can spell", self.cfg.cls, *lost)

    def _fault(self, episode: Episode, problem: str) -> None:
        episode.fault, episode.done = f"{problem} (env.cls={self.cfg.cls}, prompt {episode.prompt!r:.120})", True

    def observation_ids(self, observation: str | list[dict], chat: bool, stopped: bool) -> list[int]:
        """The tokens that put ``observation`` in the context after a policy turn (which ended on a
        stop token if ``stopped``): in a chat, what the chat template writes after an assistant
        message's content, then the observation's messages and the next assistant header."""
        if not chat:
            return self.tokenizer(observation, add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
        base, tail = self._probe_rendered
        full = self.tokenizer.apply_chat_template(_PROBE + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(base):
            raise EnvError("the chat template renders a conversation's earlier messages differently once more "
                           "follow, so an observation cannot be appended as tokens; use text prompts "
                           "(data.chat_template=false) with this tokenizer")
        if stopped:  # the policy's stop token closed its message already
            tail = tail.removeprefix(self._stop_text(tail))
        return self.tokenizer(tail + full[len(base):], add_special_tokens=False)["input_ids"]

    @functools.cached_property
    def _probe_rendered(self) -> tuple[str, str]:
        """(the probe conversation as the chat template renders it, what the template writes after an
        assistant message's content: ``"<|im_end|>\n"`` in ChatML), rendered once."""
        base = self.tokenizer.apply_chat_template(_PROBE, tokenize=False)
        return base, base[base.rindex(_PROBE[1]["content"]) + 1:]

    def _stop_text(self, tail: str) -> str:
        """The text of the stop token that begins ``tail`` (the EOS, e.g. ``<|im_end|>``), or ""."""
        eos = self.tokenizer.eos_token or ""
        return eos if eos and tail.startswith(eos) else ""

    def _pad(self, episodes: list[Episode]) -> tuple[Rollout, torch.Tensor]:
        """The episodes as one rollout (prompts left-, responses right-padded) and their (B, R) token scores."""
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad)
        width = max(len(e.tokens) for e in episodes)
        responses = torch.full((len(episodes), width), pad, dtype=torch.long)
        attended = torch.zeros((len(episodes), width), dtype=torch.bool)
        actions = torch.zeros((len(episodes), width), dtype=torch.bool)
        scores = torch.zeros((len(episodes), width))
        for row, e in enumerate(episodes):
            n = len(e.tokens)
            responses[row, :n] = torch.tensor(e.tokens, dtype=torch.long)
            attended[row, :n] = True
            actions[row, :n] = torch.tensor(e.actions)
            scores[row, :n] = torch.tensor(e.scores)
        rollout = Rollout(torch.cat([prompt_ids, responses], dim=1), torch.cat([prompt_mask, attended.long()], dim=1),
                          actions, prompt_ids.shape[1])
        return rollout, scores


class EpisodeStream:
    """Episodes streamed through a continuous batcher (a ``ContinuousBatcher`` or a
    ``VllmBatcher``): each policy turn is a batcher request keyed as its episode; a finished turn
    starts the environment's step (``turn``), and an answered step queues the episode's next turn
    or ends the episode (``answered``). A streaming maker drives it beside its prompt intake;
    ``run`` drives it alone (evaluation). ``runner`` None: no environment (a maker of single answers)."""

    def __init__(self, runner: EpisodeRunner | None, max_new_tokens: int):
        self.runner, self.max_new_tokens = runner, max_new_tokens
        self.running: dict[tuple, Episode] = {}  # (batch number, prompt index, sample) -> its episode
        self.stepping: dict[concurrent.futures.Future, Episode] = {}  # the environment steps under way: future -> episode

    def open(self, key: tuple, prompt_ids: list[int], expected_len: float | None = None) -> Request:
        """A new episode's first turn, as a batcher request."""
        episode = self.running[key[:3]] = self.runner.open(prompt_ids, key[4], key)
        return self._request(episode, expected_len)

    def start(self, batcher, keys: Sequence[tuple], prompt_ids: list[int], expected_len: float | None = None) -> None:
        """Open one episode per key (a prompt's samples) and queue their first turns in ``batcher``."""
        batcher.submit(self.open(key, prompt_ids, expected_len) for key in keys)

    def turn(self, finished) -> None:
        """The policy's turn ``finished`` is appended to its episode, whose environment step starts."""
        episode = self.running[finished.key[:3]]
        future = self.runner.turn(episode, finished.tokens, finished.log_probs, finished.versions, finished.stopped)
        self.stepping[future] = episode

    def run(self, batcher, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Prompt]) -> list[Episode]:
        """One episode per prompt, to its end, through ``batcher``; in the prompts' order."""
        return run_stream(self, batcher, prompt_ids, prompts)

    def answered(self, batcher, wait: bool) -> list[Episode]:
        """Take the environment steps that are done (with ``wait``, and none done, wait a moment for
        one: nothing else is running); queue each such episode's next turn, and return those that ended."""
        if not self.stepping:
            return []
        if wait:
            concurrent.futures.wait(list(self.stepping), timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        ended, turns = [], []
        for future in [f for f in self.stepping if f.done()]:
            episode = self.stepping.pop(future)
            self.runner.answer(episode, future)
            if episode.done:
                ended.append(self.running.pop(episode.key[:3]))
            else:
                turns.append(self._request(episode))
        batcher.submit(turns)
        return ended

    def _request(self, episode: Episode, expected_len: float | None = None) -> Request:
        return Request(episode.key, self.runner.context(episode),
                       max_new_tokens=min(self.runner.room(episode), self.max_new_tokens), expected_len=expected_len)


def run_stream(stream, batcher, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Prompt]) -> list[Episode]:
    """Drive ``stream`` (an ``EpisodeStream``, or any stream of its interface: ``start``,
    ``answered``, ``turn``, ``stepping``) alone through ``batcher`` until one episode per prompt has
    ended; the episodes in the prompts' order (evaluation, ``ray-ppo local``)."""
    for i, (ids, p) in enumerate(zip(prompt_ids, prompts, strict=True)):
        stream.start(batcher, [(0, i, 0, None, p)], list(ids))
    ended = []
    while batcher.busy or stream.stepping:
        ended += stream.answered(batcher, wait=not batcher.busy)
        if batcher.busy:
            for turn in batcher.step():
                stream.turn(turn)
    return sorted(ended, key=lambda e: e.key[1])

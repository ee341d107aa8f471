"""Bring your own agent: a maker serves its policy behind an OpenAI-compatible endpoint, and agent
code that calls it is trained on the exact tokens of its calls.

    async def agent(prompt, endpoint):              # agent.fn=my_module:agent
        client = endpoint.async_client()            # an openai.AsyncOpenAI for this episode
        reply = await client.chat.completions.create(model=endpoint.model, messages=[...], tools=[...])
        ...                                         # call again with the history, run tools
        return 1.0                                  # the episode's reward (or one per call)

Each episode gets its own URL (``http://HOST:PORT/episodes/ID/v1``) and the maker's key. A call's
messages are rendered with the tokenizer's chat template (with ``tools`` where it renders them) and
generated through the maker's continuous batcher, like every other turn: each token keeps its
sampler's log-prob and the policy version that sampled it.

**Exact tokens.** An episode is one token sequence: the first call's rendered prompt, then each
answer as sampled and, between answers, the tokens of the messages the agent added. Call k+1 must
repeat call k's messages and the answer it got (content and tool calls as returned), then add
messages; those are rendered as an environment's observation is (``EpisodeRunner.observation_ids``:
what the chat template writes after an answer, the new messages, the next assistant header). So
nothing the policy said is re-tokenized. A call that edits the history instead is refused (HTTP
400, saying what differs) and ends its episode as a fault. With ``n`` > 1 the episode goes on with
the answer the next call repeats (the first, if none follows). Only the policy's tokens are trained.

**Sampling.** Every call samples with the run's settings (``maker.temperature``, ``top_p``,
``top_k``; greedy in a greedy evaluation), which the behaviour log-probs and the trainer assume; a
call's own ``temperature`` and ``top_p`` are counted in ``sampling_overridden`` where they differ.
``max_tokens`` caps the answer below ``maker.max_new_tokens`` and the episode's room
(``env.max_tokens``); ``stop`` strings end its text (its tokens after the string are dropped from the episode).
Past the episode's budget (``env.max_turns`` calls, or no room left in ``env.max_tokens``) every
call gets an empty answer cut at its length (``calls_past_budget``): the episode ends there, as an
environment's does.

**Faults.** An agent that raises, outlasts ``agent.timeout_s``, returns something other than a
reward, or makes no call ends its episode as a fault (``Episode.fault``, the run goes on); the
answers it was given stay in the episode, and one that made no call gets one answer to its prompt
(every item holds a token the policy generated). A call with a malformed body gets a 400 saying
which field is wrong, a wrong key a 401.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import math
import numbers
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ray_ppo.config import AgentConfig, EnvConfig
from ray_ppo.data import Prompt
from ray_ppo.env import import_named
from ray_ppo.makers.episodes import Episode, EpisodeRunner, run_stream
from ray_ppo.models.continuous import Request
from ray_ppo.tools import parse_tool_calls, without_tool_calls


class AgentError(ValueError):
    """An agent function that cannot be loaded, or an answer that is not a reward."""


class BadCall(Exception):
    """A call the endpoint refuses: HTTP ``status`` with an OpenAI-shaped error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
        return {"error": {"message": str(self), "type": kind.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def load_agent_fn(path: str) -> Callable:
    """The function named by ``module:function`` (``agent.fn``)."""
    fn, module_name, name = import_named(path, "agent.fn", "module:function", "ray_ppo.tasks.calculator_agent:agent",
                                         AgentError)
    if not callable(fn):
        raise AgentError(f"agent.fn={path!r}: module {module_name!r} has no function {name!r}")
    return fn


class Connections:
    """The HTTP connection pools a maker's agents share (``httpx``, built on first use): an
    ``openai`` client builds its own otherwise, with an SSL context, about 40 ms each, once per
    episode. Proxy settings of the environment are not read: the endpoint is on this node. A
    client's ``close`` (``async with client``) leaves them open for the other episodes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pools: dict[str, Any] = {}

    def get(self, kind: str):
        """The shared ``httpx.Client`` (``kind`` "sync") or ``httpx.AsyncClient`` ("async")."""
        with self.lock:
            if kind not in self.pools:
                import httpx

                base = httpx.Client if kind == "sync" else httpx.AsyncClient
                shared = type("Shared" + base.__name__, (base,), {"close": lambda self: None,
                                                                   "aclose": _no_close})
                self.pools[kind] = shared(trust_env=False, limits=httpx.Limits(max_connections=None,
                                                                                max_keepalive_connections=256))
            return self.pools[kind]


async def _no_close(self) -> None:
    return None


@dataclass(frozen=True)
class Endpoint:
    """What an agent gets for one episode: the URL and key of its maker's endpoint."""

    base_url: str
    """``http://HOST:PORT/episodes/ID/v1``: give it to any OpenAI-compatible client."""
    api_key: str
    model: str
    """The name the endpoint answers as (any name is accepted in a request)."""
    call_timeout_s: float
    connections: Connections | None = field(default=None, repr=False, compare=False)

    def client(self):
        """An ``openai.OpenAI`` client for this episode. It does not retry: a retried call would be a
        second call of the episode."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.call_timeout_s, max_retries=0,
                             http_client=self.connections.get("sync") if self.connections else None)

    def async_client(self):
        """An ``openai.AsyncOpenAI`` client for this episode (no retries, as ``client``)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.call_timeout_s,
                                  max_retries=0, http_client=self.connections.get("async") if self.connections else None)


@dataclass
class Answer:
    """One choice of a call: the tokens kept (a ``stop`` string cuts them), with their sampler
    log-probs and versions, and the assistant message returned for it."""

    tokens: list[int]
    log_probs: list[float]
    versions: list[int]
    stopped: bool
    message: dict
    finish_reason: str


@dataclass
class AgentEpisode:
    """An agent's episode as its calls arrive: the ``Episode`` it builds, the last call's messages
    and the answers it returned (not yet in the episode: the next call says which one goes on)."""

    id: str
    episode: Episode
    stream: AgentStream
    messages: list[dict] | None = None
    tools: list | None = None
    answers: list[Answer] = field(default_factory=list)
    call_ends: list[int] = field(default_factory=list)
    """Per call in the episode: the index after its answer's last token (a call past the budget:
    after the episode's last token)."""
    busy: bool = False
    closed: bool = False
    full: bool = False
    """The episode's budget is spent: every further call gets an empty answer."""


@dataclass
class _Pending:
    """A call in the batcher: its choices as they finish, and the future its handler awaits."""

    future: asyncio.Future
    n: int
    finished: list = field(default_factory=list)


class AgentRunner(EpisodeRunner):
    """Runs agent episodes for a maker.

    Responsibilities: serve the endpoint (Starlette on uvicorn, on the runner's event loop, where
    the agents run too), turn each call into batcher requests and its answers into the response,
    keep each episode's tokens exact (refusing a call whose history was edited), and end a faulty
    episode alone. ``stream`` gives the ``AgentStream`` a maker (or an evaluation) drives."""

    def __init__(self, fn: Callable, cfg: AgentConfig, env: EnvConfig, tokenizer, model_name: str = "policy",
                 max_prompt_len: int = 512):
        super().__init__(None, env, tokenizer, chat_template=True)
        self.fn, self.agent, self.model_name, self.max_prompt_len = fn, cfg, model_name, max_prompt_len
        self.api_key = secrets.token_urlsafe(24)
        self.live: dict[str, AgentEpisode] = {}
        self.ids = itertools.count()
        self.host = cfg.host or "127.0.0.1"
        """Where the endpoint binds: ``agent.host``; a maker's Ray shell sets its node's address
        where that is null (``ray_ppo.makers.worker``), an evaluation in the driver binds loopback."""
        self.base_url: str | None = None
        self.server = None
        self.connections = Connections()

    # -- the maker's side ---------------------------------------------------------------------------
    def stream(self, max_new_tokens: int) -> AgentStream:
        """A stream of agent episodes through a batcher; the endpoint starts with the first."""
        if self.server is None:
            self._serve()
        return AgentStream(self, max_new_tokens)

    def run(self, prompt_ids, prompts, sample):
        """Agent episodes run only through a continuous batcher (``stream``): refused, saying so."""
        raise AgentError("agent episodes are generated through continuous batching: set maker.max_running; an "
                         "evaluation runs agents on the HF model's batcher (maker.engine=hf)")

    def launch(self, stream: AgentStream, key: tuple, prompt_ids: list[int], prompt: Prompt) -> None:
        """Start the agent of one episode on the event loop."""
        episode = Episode(prompt, list(prompt_ids), True, key=key)
        ae = AgentEpisode(f"{next(self.ids)}-{secrets.token_hex(4)}", episode, stream)
        self.live[ae.id] = ae
        asyncio.run_coroutine_threadsafe(self._run_agent(ae), self.loop)

    async def _run_agent(self, ae: AgentEpisode) -> None:
        endpoint = Endpoint(f"{self.base_url}/episodes/{ae.id}/v1", self.api_key, self.model_name,
                            self.agent.call_timeout_s, self.connections)
        episode = ae.episode
        try:
            call = self.fn(episode.prompt, endpoint) if inspect.iscoroutinefunction(self.fn) else \
                asyncio.to_thread(self.fn, episode.prompt, endpoint)
            result = await asyncio.wait_for(call, self.agent.timeout_s)
            self._commit(ae, 0)
            self._reward(ae, result)
        except TimeoutError:
            self._fault(episode, f"the agent ran longer than agent.timeout_s={self.agent.timeout_s:g} s")
        except (AgentError, BadCall) as e:
            self._fault(episode, str(e))
        except Exception as e:  # the agent's own error ends its episode, not the run
            self._fault(episode, f"the agent raised {type(e).__name__}: {e}")
        finally:
            self._commit(ae, 0)  # a faulty agent's last answer stays: those tokens were sampled
            ae.closed = episode.done = True
            self.live.pop(ae.id, None)
            ae.stream.ended.put(ae)

    def _reward(self, ae: AgentEpisode, result: Any) -> None:
        """Put the agent's reward (one, at the last answer's end; or one per call, each at its
        answer's end) on the episode's tokens."""
        episode, ends = ae.episode, ae.call_ends
        if not ends:
            raise AgentError("the agent made no call, so there is nothing to train on")
        rewards = result if isinstance(result, (list, tuple)) else [result]
        if not all(_finite(r) for r in rewards):
            raise AgentError(f"the agent returned {result!r:.80}, not a finite reward or a list of them")
        if len(rewards) == 1:
            episode.scores[ends[-1] - 1] += float(rewards[0])
        elif len(rewards) == len(ends):
            for end, reward in zip(ends, rewards, strict=True):
                episode.scores[end - 1] += float(reward)
        else:
            raise AgentError(f"the agent returned {len(rewards)} rewards for {len(ends)} calls; return one "
                             f"reward, or one per call")

    def _fault(self, episode: Episode, problem: str) -> None:
        """End ``episode`` as a fault; its first fault is the one it keeps (an agent that raises on a
        refused call raised because of it)."""
        if episode.fault is not None:
            return
        name = f"{getattr(self.fn, '__module__', '?')}:{getattr(self.fn, '__qualname__', self.fn)}"
        episode.fault, episode.done = f"{problem} (agent.fn={name}, prompt {episode.prompt!r:.120})", True

    # -- a call ---------------------------------------------------------------------------------------
    async def complete(self, episode_id: str, body: Any) -> dict:
        """Answer one chat-completions call of episode ``episode_id`` (on the event loop)."""
        ae = self.live.get(episode_id)
        if ae is None or ae.closed:
            raise BadCall(f"no running episode {episode_id!r}: it ended, or the URL is not one the endpoint gave",
                          404)
        call = parse_call(body)
        if ae.busy:
            raise BadCall("a call of this episode is still running: an episode is one conversation, one call at "
                          "a time")
        ae.busy = True
        try:
            episode = ae.episode
            context = None if ae.full else self._context(ae, call)
            if context is None:  # past the episode's budget: an empty answer, cut at its length
                ae.full = True
                episode.info["calls_past_budget"] = episode.info.get("calls_past_budget", 0.0) + 1
                ae.call_ends.append(len(episode.tokens))  # a call all the same: its reward lands on the last token
                empty = Answer([], [], [], False, {"role": "assistant", "content": ""}, "length")
                return self._response(ae, [empty], len(self.context(episode)), episode.turns + 1, call.logprobs)
            cap = min(call.max_tokens or ae.stream.max_new_tokens, ae.stream.max_new_tokens, self.room(episode))
            future = self.loop.create_future()
            number = episode.turns + 1
            requests = [Request((*episode.key, ae.id, number, c), context, max_new_tokens=cap)
                        for c in range(call.n)]
            ae.stream.submit(_Pending(future, call.n), requests)
            finished = await future
            if ae.closed:
                raise BadCall("the episode ended while this call ran (its agent returned or timed out)", 404)
            ae.answers = [self._answer(f, call) for f in sorted(finished, key=lambda f: f.key[-1])]
            ae.messages, ae.tools = call.messages, call.tools
            episode.info["sampling_overridden"] = episode.info.get("sampling_overridden", 0.0) + float(
                call.sampling_differs(ae.stream.sampling))
            return self._response(ae, ae.answers, len(context), number, call.logprobs)
        finally:
            ae.busy = False

    def _context(self, ae: AgentEpisode, call: Call) -> list[int] | None:
        """The tokens call ``call`` continues: the episode's so far and the added messages' (the
        first call: its rendered messages, which become the episode's prompt). None where the
        episode's budget is spent: its calls (``env.max_turns``), or its tokens (``env.max_tokens``:
        the added messages leave no room for an answer), as an environment's episode ends there."""
        episode = ae.episode
        if episode.turns + bool(ae.answers) >= self.cfg.max_turns:  # the calls made, the last one's answer pending
            self._commit(ae, self._extends(ae, call))
            return None
        if ae.messages is None:
            prompt_ids = self._render(call)
            if len(prompt_ids) > self.max_prompt_len:  # the episode keeps its encoded prompt
                raise BadCall(f"the first call's messages render to {len(prompt_ids)} tokens, more than "
                              f"data.max_prompt_len={self.max_prompt_len} (an episode's prompt); shorten them, or "
                              f"raise data.max_prompt_len", param="messages", code="context_length_exceeded")
            episode.prompt_ids = prompt_ids
        else:
            chosen = self._extends(ae, call)
            self._commit(ae, chosen)
            added = self.observation_ids(call.messages[len(ae.messages) + 1:], True, episode.stopped)
            if len(episode.tokens) + len(added) >= self.cfg.max_tokens:
                return None
            episode.tokens += added
            episode.actions += [False] * len(added)
            episode.scores += [0.0] * len(added)
            episode.log_probs += [0.0] * len(added)
            episode.versions += [episode.versions[-1]] * len(added)
        return self.context(episode)

    def _render(self, call: Call) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(call.messages, tools=call.tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # the template's own check (a role it does not know, ...)
            raise BadCall(f"the chat template cannot render these messages: {e}", param="messages") from e
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _extends(self, ae: AgentEpisode, call: Call) -> int:
        """Which answer of the last call ``call`` goes on from: its messages must repeat the last
        call's and then that answer. A call that does not ends the episode (a fault) and is refused."""
        before, messages = ae.messages, call.messages
        problem = None
        if call.tools != ae.tools:
            problem = "its tools differ from the first call's"
        elif len(messages) <= len(before) + 1:
            problem = f"it has {len(messages)} messages: the last call's {len(before)}, its answer, and at least one new"
        else:
            edited = next((i for i, (a, b) in enumerate(zip(before, messages)) if _plain(a) != _plain(b)), None)
            if edited is not None:
                problem = f"message {edited} differs from the last call's"
            else:
                chosen = next((i for i, a in enumerate(ae.answers) if _same_answer(a.message, messages[len(before)])),
                              None)
                if chosen is not None:
                    return chosen
                problem = f"message {len(before)} is not the answer the last call returned"
        last = ae.episode.turns + 1  # the last call, whose answer is not in the episode yet
        message = (f"call {last + 1} of this episode does not extend call {last}: {problem}. "
                   f"Episodes are trained on the exact tokens of their calls, so each call must repeat the last "
                   f"call's messages and the answer it got, then add messages; this episode ends here")
        ae.closed = True
        ae.episode.info["history_edited"] = 1.0
        self._commit(ae, 0)  # what came before the edit stays in the episode
        self._fault(ae.episode, message)
        raise BadCall(message, param="messages", code="history_edited")

    def _commit(self, ae: AgentEpisode, chosen: int) -> None:
        """Put answer ``chosen`` of the last call in the episode (once)."""
        if not ae.answers:
            return
        answer, ae.answers = ae.answers[chosen], []
        episode = ae.episode
        before = len(episode.tokens)
        self._policy_turn(episode, answer.tokens, answer.stopped)
        kept = len(episode.tokens) - before
        episode.log_probs += answer.log_probs[:kept]
        episode.versions += answer.versions[:kept]
        ae.call_ends.append(len(episode.tokens))
        calls = len(answer.message.get("tool_calls") or [])
        episode.info["tool_calls"] = episode.info.get("tool_calls", 0.0) + calls

    def _answer(self, finished, call: Call) -> Answer:
        """A finished sequence as a choice: cut at the first ``stop`` string, its tool calls parsed."""
        tokens, stopped, reason = list(finished.tokens), finished.stopped, "stop" if finished.stopped else "length"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min(((text.index(s), s) for s in call.stop if s in text), default=None)
        if cut is not None:  # the tokens through the stop string stay (the policy wrote it), the text ends before it
            end = cut[0] + len(cut[1])
            keep = next(k for k in range(1, len(tokens) + 1)
                        if len(self.tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= end)
            tokens, stopped, reason, text = tokens[:keep], False, "stop", text[:cut[0]]
        message = {"role": "assistant", "content": text}
        calls = self._tool_calls(text) if call.tools else None
        if calls:
            rest = without_tool_calls(text)
            message, reason = {"role": "assistant", "content": rest or None, "tool_calls": calls}, "tool_calls"
        return Answer(tokens, list(finished.log_probs[:len(tokens)]), list(finished.versions[:len(tokens)]),
                      stopped, message, reason)

    def _tool_calls(self, text: str) -> list[dict] | None:
        """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text`` (the
        Hermes format, which Qwen's and SmolLM's templates use), as ``ray_ppo.tools.parse_tool_calls``
        reads them, as OpenAI tool calls; None if there is none, or one is malformed (the text is
        then the answer's content)."""
        calls = parse_tool_calls(text)
        if not calls or any(c["name"] is None for c in calls):
            return None
        return [{"id": f"call_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for i, c in enumerate(calls)]

    def _response(self, ae: AgentEpisode, answers: list[Answer], prompt_tokens: int, number: int,
                  logprobs: bool) -> dict:
        choices = []
        for i, a in enumerate(answers):
            choice = {"index": i, "message": a.message, "finish_reason": a.finish_reason, "token_ids": a.tokens,
                      "logprobs": None}
            if logprobs:
                choice["logprobs"] = {"content": [self._logprob(t, lp) for t, lp in zip(a.tokens, a.log_probs,
                                                                                       strict=True)]}
            choices.append(choice)
        completion = sum(len(a.tokens) for a in answers)
        return {"id": f"chatcmpl-{ae.id}-{number}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def _logprob(self, token: int, log_prob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode()), "top_logprobs": []}

    # -- the server -----------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Start the endpoint on the event loop, bound to ``host`` on a free port."""
        import uvicorn

        host = self.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(endpoint_app(self), log_level="warning", access_log=False,
                                                    lifespan="off"))
        asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host}:{port} within 30 s")
            time.sleep(0.01)
        self.base_url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def close(self) -> None:
        """Stop the endpoint."""
        if self.server is not None:
            self.server.should_exit = True


class AgentStream:
    """Agent episodes through a continuous batcher, as ``EpisodeStream`` streams environment
    episodes: ``start`` launches a group's agents; their calls queue here (from the event loop)
    until the maker's thread submits them (``answered``); a finished sequence goes back to its call
    (``turn``); ``answered`` also returns the episodes whose agents ended."""

    def __init__(self, runner: AgentRunner, max_new_tokens: int):
        self.runner, self.max_new_tokens = runner, max_new_tokens
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # batcher requests the calls made
        self.ended: queue.SimpleQueue = queue.SimpleQueue()  # the AgentEpisodes whose agents returned
        self.calls: dict[tuple, _Pending] = {}  # (episode id, call number) -> the call
        self.fillers: dict[tuple, Episode] = {}  # (episode id, 0) -> an ended episode awaiting its first answer
        self.done: list[Episode] = []  # ended episodes not yet returned by ``answered``
        self.alive = 0
        self.sampling = None  # the batcher's sampling settings, once one is driven

    @property
    def stepping(self) -> int:
        """Agents still running (their episodes not yet returned by ``answered``)."""
        return self.alive

    def start(self, batcher, keys: Sequence[tuple], prompt_ids: list[int], expected_len: float | None = None) -> None:
        """Launch one agent per key (a prompt's samples)."""
        self.sampling = getattr(batcher, "params", None)
        for key in keys:
            self.alive += 1
            self.runner.launch(self, key, prompt_ids, key[4])

    def _first_answer(self, batcher, ae: AgentEpisode) -> None:
        """An episode that ended without a call gets one answer to its prompt, as an environment's
        episode always holds the policy's first turn: a sample like any other, which its fault makes
        neutral (an item must hold a token the policy generated)."""
        episode = ae.episode
        self.fillers[(ae.id, 0)] = episode
        batcher.submit([Request((*episode.key, ae.id, 0, 0), list(episode.prompt_ids),
                                max_new_tokens=min(self.max_new_tokens, self.runner.room(episode)))])

    def submit(self, call: _Pending, requests: list[Request]) -> None:
        """From the event loop: queue a call's requests for the maker's thread."""
        for r in requests:
            self.calls[r.key[-3:-1]] = call
        self.inbox.put(requests)

    def turn(self, finished) -> None:
        """A call's sequence finished; once all its choices have, its handler goes on."""
        episode = self.fillers.pop(finished.key[-3:-1], None)
        if episode is not None:  # an ended episode's first answer (``_first_answer``): now it is done
            self.runner._policy_turn(episode, list(finished.tokens), finished.stopped)
            episode.log_probs, episode.versions = list(finished.log_probs), list(finished.versions)
            self.done.append(episode)
            return
        call = self.calls.get(finished.key[-3:-1])
        if call is None:
            return
        call.finished.append(finished)
        if len(call.finished) == call.n:
            del self.calls[finished.key[-3:-1]]
            self.runner.loop.call_soon_threadsafe(_resolve, call.future, call.finished)

    def answered(self, batcher, wait: bool) -> list[Episode]:
        """Submit the calls made since; return the episodes whose agents ended. With ``wait`` and
        nothing to do, wait a moment for a call or an end."""
        if wait and self.alive and self.inbox.empty() and self.ended.empty() and not self.done:
            try:
                batcher.submit(self.inbox.get(timeout=0.05))
            except queue.Empty:
                pass
        while not self.inbox.empty():
            batcher.submit(self.inbox.get())
        while not self.ended.empty():
            ae = self.ended.get()
            if ae.episode.tokens:
                self.done.append(ae.episode)
            else:
                self._first_answer(batcher, ae)
        ended, self.done = self.done, []
        self.alive -= len(ended)
        return ended

    def run(self, batcher, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Prompt]) -> list[Episode]:
        """One episode per prompt, to its end, through ``batcher``; in the prompts' order."""
        return run_stream(self, batcher, prompt_ids, prompts)


@dataclass
class Call:
    """A chat-completions request body, checked."""

    messages: list[dict]
    tools: list | None
    n: int
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    temperature: float | None
    top_p: float | None

    def sampling_differs(self, params) -> bool:
        """Whether the call asked for a temperature or top_p other than the run's (``params``)."""
        if params is None:
            return False
        return any(v is not None and not math.isclose(v, getattr(params, k)) for k, v in
                   (("temperature", self.temperature), ("top_p", self.top_p)))


def parse_call(body: Any) -> Call:
    """The checked fields of a chat-completions body; ``BadCall`` naming the first wrong one."""
    if not isinstance(body, dict):
        raise BadCall("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadCall("'messages' must be a non-empty list of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadCall(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        if not isinstance(m.get("content"), (str, type(None))) and not _text_parts(m.get("content")):
            raise BadCall(f"messages[{i}].content must be a text (or text parts)", param=f"messages[{i}].content")
    messages = [{**m, "content": _text(m.get("content"))} for m in messages]
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadCall("'tools' must be a list of tool objects", param="tools")
    if body.get("tool_choice") not in (None, "auto", "none") and tools:
        raise BadCall("tool_choice: only 'auto' and 'none' are served (the policy decides whether to call a "
                      "tool, as it is trained to)", param="tool_choice")
    n = _int(body, "n", 1, 1, 16)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _int(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                          None, 1, None)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadCall("'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    for key in ("temperature", "top_p"):
        if body.get(key) is not None and (isinstance(body[key], bool) or not isinstance(body[key], numbers.Real)):
            raise BadCall(f"'{key}' must be a number", param=key)
    if body.get("stream"):
        raise BadCall("'stream': streamed responses are not served; call without stream", param="stream")
    return Call(messages, tools or None, n, max_tokens, stop, bool(body.get("logprobs")), body.get("temperature"),
                body.get("top_p"))


def endpoint_app(runner: AgentRunner):
    """The Starlette app (FastAPI's core, without the request models this endpoint checks itself):
    ``POST /episodes/{id}/v1/chat/completions`` and ``GET /episodes/{id}/v1/models``, behind the runner's key."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def refused(e: BadCall) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def unauthorised(request) -> JSONResponse | None:
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {runner.api_key}".encode()):
            return None
        return refused(BadCall("a wrong or missing API key: use the key the endpoint gave the agent", 401))

    async def chat_completions(request):
        if (refusal := unauthorised(request)) is not None:
            return refusal
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return refused(BadCall(f"the request body is not JSON: {e}"))
        try:
            return JSONResponse(await runner.complete(request.path_params["episode_id"], body))
        except BadCall as e:
            return refused(e)

    async def models(request):
        if (refusal := unauthorised(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [{"id": runner.model_name, "object": "model",
                                                         "owned_by": "ray_ppo"}]})

    return Starlette(routes=[Route("/episodes/{episode_id}/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/episodes/{episode_id}/v1/models", models, methods=["GET"])])


def _resolve(future: asyncio.Future, finished: list) -> None:
    if not future.done():
        future.set_result(finished)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))


def _int(body: dict, key: str, default: int | None, low: int, high: int | None) -> int | None:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise BadCall(f"'{key}' must be a whole number {bound}, not {value!r}", param=key)
    return value


def _text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def _text(content: Any) -> str | None:
    """A message's content as one text (text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content


def _plain(message: dict) -> dict:
    """A message without its empty fields, for comparing history."""
    return {k: v for k, v in message.items() if v not in (None, "", [])}


def _same_answer(returned: dict, given: dict) -> bool:
    """Whether ``given`` repeats the assistant message ``returned``: same content (None and "" alike)
    and the same tool calls (names and arguments, compared as JSON values)."""
    if given.get("role") != "assistant" or (returned.get("content") or "") != (given.get("content") or ""):
        return False
    ours, theirs = returned.get("tool_calls") or [], given.get("tool_calls") or []
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        try:
            fa, fb = a["function"], b["function"]
            if fa["name"] != fb["name"] or json.loads(fa["arguments"]) != _json(fb.get("arguments")):
                return False
        except (KeyError, TypeError, ValueError):
            return False
    return True


def _json(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


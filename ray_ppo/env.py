"""Environments for multi-turn rollouts: the policy talks to one over several turns.

An episode starts from a prompt row. Each turn the policy generates a response; the environment
answers with a ``Turn``: an observation (text, or chat messages such as a tool's result) that is
put in the context for the next turn, a reward, and whether the episode is done. The episode also
ends at ``env.max_turns`` or when its tokens reach ``env.max_tokens``.

    class Guess(Environment):
        def __init__(self, prompt):
            self.target = int(prompt_text(prompt).split()[-1])

        async def step(self, response: str) -> Turn:   # a plain ``def step`` works too
            guess = int(response.split()[0]) if response.split() else None
            if guess == self.target:
                return Turn(reward=1.0, done=True)
            return Turn(observation="higher" if guess < self.target else "lower")

Name the class in the config (``env.cls: my_module:Guess``); every maker builds one instance per
episode and runs many episodes at once (``ray_ppo.makers.episodes``). ``step`` may be a coroutine
(awaiting I/O) or a plain function (run in a thread). This module imports neither torch nor Ray.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from ray_ppo.data import ROLES_FIX, Prompt, unknown_role


@dataclass
class Turn:
    """The environment's answer to one policy turn."""

    observation: str | list[dict] | None = None
    """Put in the context before the policy's next turn: a text (a user message in a chat run,
    else appended as it is), or chat messages (e.g. ``{"role": "tool", "content": "42"}``). None
    ends the episode as ``done`` does: the policy has nothing new to answer."""
    reward: float = 0.0
    """The reward of this turn; an episode's reward is the sum of its turns'."""
    done: bool = False
    """The episode ends here."""
    info: dict[str, float] = field(default_factory=dict)
    """Counts to report (e.g. ``{"tool_calls": 1}``): summed over the episode, averaged over
    episodes in the ``env/...`` metrics."""


class Environment:
    """One episode. Subclass it, or write any class with this constructor and ``step``.

    ``tools``: JSON schemas of the tools the policy may call, rendered into the prompt by chat
    templates that support tools (``apply_chat_template(..., tools=...)``); None for none.
    """

    tools: list[dict] | None = None

    def __init__(self, prompt: Prompt):
        self.prompt = prompt

    async def step(self, response: str) -> Turn:
        """Answer the policy's response (decoded, special tokens removed)."""
        raise NotImplementedError


class EnvError(ValueError):
    """An environment class that cannot be loaded, or an answer that is not a ``Turn``."""


def load_env_class(path: str) -> type:
    """The class named by ``module:Class`` (``env.cls``)."""
    cls, module_name, name = import_named(path, "env.cls", "module:Class", "ray_ppo.tasks.calculator:CalculatorEnv",
                                          EnvError)
    if cls is None or not callable(getattr(cls, "step", None)):
        raise EnvError(f"env.cls={path!r}: module {module_name!r} has no class {name!r} with a step method")
    return cls


def import_named(path: str, key: str, form: str, example: str, error: type[Exception]) -> tuple[Any, str, str]:
    """(what ``module:name`` names, or None if the module has no such name; the module's name; the
    name), for the setting ``key`` (``env.cls``, ``agent.fn``); ``error`` saying why not where
    ``path`` is not of the ``form`` (e.g. ``example``) or its module does not import."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise error(f"{key}={path!r} is not of the form {form} (e.g. {example})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{key}={path!r}: cannot import module {module_name!r} ({e}); check the name, and that "
                    f"the module is in the current directory, on PYTHONPATH or installed (on every node)") from e
    return getattr(module, name, None), module_name, name


def check_turn(turn: Any) -> Turn:
    """``turn`` if it is a well-formed ``Turn``; else ``EnvError`` saying what is wrong."""
    if not isinstance(turn, Turn):
        raise EnvError(f"step returned {type(turn).__name__} {turn!r:.80}, not a ray_ppo.env.Turn")
    reward = turn.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"step returned a Turn whose reward is {reward!r}, not a finite number")
    obs = turn.observation
    is_messages = isinstance(obs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in obs)
    if obs is not None and not isinstance(obs, str) and not is_messages:
        raise EnvError(f"step returned a Turn whose observation is {type(obs).__name__} {obs!r:.80}, "
                       f"not a text or a list of chat messages with role and content")
    role = unknown_role(obs) if is_messages else None
    if role:
        raise EnvError(f"step returned a Turn whose observation's {role}; {ROLES_FIX}")
    if not isinstance(turn.info, dict) or not all(isinstance(v, numbers.Real) for v in turn.info.values()):
        raise EnvError(f"step returned a Turn whose info is {turn.info!r:.80}, not a dict of numbers")
    return turn


async def take_step(env: Any, response: str, timeout_s: float) -> Turn:
    """``env.step(response)``, awaited (a plain function runs in a thread), checked (``check_turn``);
    ``TimeoutError`` after ``timeout_s`` seconds."""
    step = env.step
    call = step(response) if inspect.iscoroutinefunction(step) else asyncio.to_thread(step, response)
    return check_turn(await asyncio.wait_for(call, timeout_s))

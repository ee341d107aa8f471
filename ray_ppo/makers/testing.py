"""Stand-ins for the parts of a run that tests and benchmarks replace through ``PPOTrainer``'s
extension points (``experience_maker_factory``), never through a config flag; and
``coordinator_config``, the config of a coordinator driven on its own.

A simulated device (``benchmarks/overlap_sim.py``): ``SimulatedDeviceMaker`` holds a device of
``slots`` sequences whose every decode step is a wait of ``step_s`` seconds, however many of the
slots run (as a GPU kernel whose batch fits: the CPU is free meanwhile), and answers whose lengths
are drawn from ``AnswerLengths`` (lognormal). It makes the same token work per decode step in both
maker paths:

- batch by batch (``maker.max_running=0``, ``make_experience``): a generation batch decodes in
  chunks of ``slots`` sequences, one after the other; a chunk takes max(its lengths) steps, its
  short answers holding their slots until its longest ends;
- streaming (``maker.max_running > 0``): the worker drives ``SimulatedBatcher`` (the maker's
  ``batcher_class``), where a sequence frees its slot at the step its answer ends and a waiting one
  takes it at the next step.

A sequence of L tokens holds its slot for L decode steps in both (prefill is not simulated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.config import Config
from ray_ppo.data import prompt_text
from ray_ppo.env import Turn
from ray_ppo.makers.experience import MakeStats
from ray_ppo.models.continuous import Finished, Request, Slots, longest_first
from ray_ppo.tasks.toy import reward as toy_reward
from ray_ppo.tasks.turns import TwoTurnEnv


class WaitingExperienceMaker:
    """An ``ExperienceMaker`` whose rollout is a wait: the i-th batch (from 0) takes ``waits[i]``
    seconds, the last entry repeated for every batch after it, with the CPU free meanwhile (as a
    GPU kernel leaves it). Its actor and critic are the real models of ``cfg``, so weight pushes
    into it are real; its items have the toy task's shape (each prompt, ``response_len`` tokens
    of id 5, reward 0) and carry the version they were made at.

    Pass it as a factory with its waits bound: ``functools.partial(WaitingExperienceMaker,
    waits=(6.0, 0.0))`` makes a maker whose first batch takes 6 s and the rest none.
    """

    def __init__(self, cfg, name: str, device, waits: Sequence[float] = (0.0,), response_len: int = 8):
        from ray_ppo.models import load_tokenizer
        from ray_ppo.models.build import build_actor, build_critic, tokenizer_path

        if not waits or any(w < 0 for w in waits):
            raise ValueError(f"waits={tuple(waits)!r}: give at least one wait, none negative (seconds per batch)")
        self.actor, self.critic, self.ref, self.reward_model = build_actor(cfg), build_critic(cfg), None, None
        self.tokenizer = load_tokenizer(tokenizer_path(cfg))
        self.kl_coef = cfg.ppo.kl_coef  # set by weight pushes, as on a real maker
        self.name, self.waits, self.response_len, self.batches = name, tuple(waits), response_len, 0

    def make_experience(self, prompt_ids: list[list[int]], policy_version: int, kl_coef: float | None = None,
                        prompts: Sequence | None = None):
        start = time.perf_counter()
        time.sleep(self.waits[min(self.batches, len(self.waits) - 1)])
        waited = time.perf_counter() - start
        self.batches += 1
        items = [ExperienceItem.filled(torch.tensor(ids), torch.full((self.response_len,), 5), reward=0.0,
                                       policy_version=policy_version, uid=f"{self.name}-{self.batches}-{i}",
                                       prompt=None if prompts is None else prompts[i])
                 for i, ids in enumerate(prompt_ids)]
        return items, MakeStats(num_samples=len(items), num_tokens=self.response_len * len(items), generate_s=waited)


@dataclasses.dataclass(frozen=True)
class AnswerLengths:
    """Answer lengths in tokens: ``round(median * exp(sigma * Z))`` with Z standard normal (a
    lognormal of that median whose log has standard deviation ``sigma``), at least 1 and at most a
    cap (``maker.max_new_tokens``). ``sigma=0``: every answer is ``median`` tokens (capped)."""

    median: float
    sigma: float = 0.0

    def __post_init__(self):
        if not self.median >= 1 or not self.sigma >= 0:
            raise ValueError(f"median={self.median}, sigma={self.sigma}: the median is at least 1 token, sigma >= 0")

    def draw(self, rng: random.Random, cap: int) -> int:
        """One length from ``rng``, in [1, cap]."""
        x = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.sigma else self.median
        return max(1, min(cap, math.floor(x + 0.5)))

    def mean(self, cap: int) -> float:
        """The expected length of ``draw`` with ``cap`` (exact: the rounded, clipped lognormal)."""
        if not self.sigma:
            return float(max(1, min(cap, math.floor(self.median + 0.5))))

        def below(x: float) -> float:  # P(median * exp(sigma * Z) < x)
            return 0.5 * (1 + math.erf(math.log(x / self.median) / (self.sigma * math.sqrt(2)))) if x > 0 else 0.0

        return 1 + sum(1 - below(k - 0.5) for k in range(2, cap + 1))  # E[L] = sum over k >= 1 of P(L >= k)


class DeviceLog:
    """A simulated device's running totals: ``sequences`` finished, their ``tokens``, decode
    ``steps``, ``slot_steps`` (each step times the sequences it ran: the tokens generated) and
    ``slept_s`` (the steps' measured waits). Kept in the JSON file ``path`` (None: in memory only),
    rewritten at most every ``every_s`` seconds, for a benchmark in another process to read
    (``DeviceLog.read``): Ray's maker stats carry no decode steps for a batch-by-batch maker."""

    FIELDS = ("sequences", "tokens", "steps", "slot_steps", "slept_s")

    def __init__(self, path: str | Path | None = None, every_s: float = 0.05):
        self.path, self.every_s = (Path(path) if path is not None else None), every_s
        self.totals = dict.fromkeys(self.FIELDS, 0)
        self.written = 0.0

    def add(self, **counts) -> None:
        for name, n in counts.items():
            self.totals[name] += n
        if self.path is not None and time.monotonic() - self.written >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.totals))
        tmp.replace(self.path)
        self.written = time.monotonic()

    @staticmethod
    def read(directory: str | Path) -> dict[str, dict]:
        """Every log in ``directory``, by file name (the maker's name)."""
        return {p.stem: json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))}


@dataclasses.dataclass
class _SimRow:
    request: Request
    length: int  # the answer's drawn length, capped
    cap: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    swaps: int = 0


class SimulatedBatcher(Slots):
    """``ray_ppo.models.continuous.ContinuousBatcher``'s interface and bookkeeping over a simulated
    device: ``step`` admits waiting requests into free slots (in order, or ``longest_first`` by
    ``Request.expected_len``), then, if any sequence runs, waits ``step_s`` seconds (``sleep``: the
    CPU is free, as under a GPU kernel) whatever the number running, and gives each running
    sequence one token at the current version. A request's answer length is ``draw()`` at
    ``submit``, capped by its ``max_new_tokens`` or ``params.max_new_tokens``; it ends when it has
    that many tokens (``stopped`` if below the cap: its last token is then the first stop id).
    Tokens are id 5, their log-probs 0. ``swap`` changes the version the next tokens record and
    counts the running sequences' caches as kept or recomputed (``kv_at_swap``; neither costs
    time here). ``log`` (a ``DeviceLog``) gets each step's counts.

    The worker builds it as ``ContinuousBatcher``: a maker's ``batcher_class`` is this class with
    ``step_s``, ``draw`` and ``log`` bound (``SimulatedDeviceMaker.batcher_class``).
    """

    def __init__(self, model, params, pad_token_id: int, stop_ids: Iterable[int], max_running: int,
                 kv_at_swap: str = "keep", greedy: bool = False, version: int = 0, generator=None,
                 schedule: str = "fifo", *, step_s: float, draw: Callable[[], int] | None = None,
                 log: DeviceLog | None = None, sleep: Callable[[float], None] = time.sleep):
        super().__init__(max_running, kv_at_swap, schedule, version)
        if step_s < 0:
            raise ValueError(f"step_s={step_s}: a decode step cannot take negative time")
        self.model, self.params, self.pad_token_id = model, params, pad_token_id
        self.stop_ids = tuple(sorted(set(stop_ids)))
        self.step_s, self.sleep, self.log = step_s, sleep, log if log is not None else DeviceLog()
        self.draw = draw or (lambda: params.max_new_tokens)
        self.lengths: dict[int, int] = {}  # id(request) -> its drawn length, while it waits
        self.rows: list[_SimRow] = []

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests``, drawing each one's answer length now (in submission order)."""
        for request in requests:
            super().submit([request])
            self.lengths[id(request)] = self.draw()

    def step(self, admit: bool = True) -> list[Finished]:
        """Admit waiting requests into free slots (unless not ``admit``), then one decode step of
        every running sequence; returns the sequences that ended at it."""
        if admit:
            self._admit()
        if not self.rows:
            return []
        start = time.perf_counter()
        self.sleep(self.step_s)
        slept = time.perf_counter() - start
        for row in self.rows:
            row.tokens.append(5)
            row.versions.append(self.version)
        self.steps += 1
        self.slot_steps += len(self.rows)
        ended = [row for row in self.rows if len(row.tokens) >= row.length]
        self.rows = [row for row in self.rows if len(row.tokens) < row.length]
        finished = [self._finished(row) for row in ended]
        self.log.add(sequences=len(finished), tokens=sum(len(f.tokens) for f in finished), steps=1,
                     slot_steps=len(self.rows) + len(ended), slept_s=slept)
        return finished

    def run(self, requests: Iterable[Request]) -> list[Finished]:
        """Generate ``requests`` to the end on an idle batcher; their results in order."""
        if self.busy:
            raise RuntimeError("run() needs an idle batcher; drive a shared one with submit() and step()")
        requests = list(requests)
        self.submit(requests)
        done = {}
        while self.busy:
            done.update({id(f.key): f for f in self.step()})
        return [done[id(r.key)] for r in requests]

    def swap(self, apply: Callable[[], None], version: int) -> None:
        """Between two steps: ``apply()``, then the next tokens are sampled at ``version``."""
        apply()
        self._swapped(version)

    def _admit(self) -> None:
        free = self.max_running - len(self.rows)
        if free <= 0 or not self.waiting:
            return
        if self.schedule == "longest_first":
            self.waiting = longest_first(self.waiting)
        for _ in range(min(free, len(self.waiting))):
            request = self.waiting.popleft()
            cap = request.max_new_tokens or self.params.max_new_tokens
            self.rows.append(_SimRow(request, min(cap, self.lengths.pop(id(request))), cap))

    def _finished(self, row: _SimRow) -> Finished:
        stopped = row.length < row.cap
        if stopped and self.stop_ids:
            row.tokens[-1] = self.stop_ids[0]
        return Finished(row.request.key, list(row.request.prompt), row.tokens, [0.0] * len(row.tokens), row.versions,
                        stopped=stopped, swaps=row.swaps)


class SimulatedDeviceMaker(WaitingExperienceMaker):
    """A maker on a simulated device (module docstring): ``slots`` sequences decode together, each
    decode step a wait of ``step_s`` seconds; answer lengths drawn from ``lengths`` with
    ``random.Random(f"{seed}/{name}")``, capped at ``maker.max_new_tokens`` (so a maker draws the
    same lengths, in the order its sequences come, in both paths). ``slots`` None:
    ``maker.max_running``, else ``maker.batch_size``.

    - ``make_experience`` (``maker.max_running=0``): the batch's sequences (``samples_per_prompt``
      per prompt) in chunks of ``slots``, each chunk one wait of max(its lengths) steps;
    - ``batcher_class`` and ``experience_of`` (``maker.max_running > 0``): the worker's batcher is a
      ``SimulatedBatcher`` drawing lengths here.

    Items have the toy task's shape (``WaitingExperienceMaker``) with the drawn response length,
    ``policy_version`` their oldest token's (``version_runs`` where their tokens span versions),
    ``truncated`` when cut at the cap. ``log_dir``: where the ``DeviceLog`` ``NAME.json`` is kept
    (None: in memory, ``self.log``).

    Pass it as a factory with its device bound: ``functools.partial(SimulatedDeviceMaker,
    step_s=0.02, lengths=AnswerLengths(8, 1.0), slots=16)``.
    """

    def __init__(self, cfg, name: str, device, step_s: float, lengths: AnswerLengths, slots: int | None = None,
                 log_dir: str | Path | None = None, seed: int = 0):
        from ray_ppo.models import stop_token_ids

        super().__init__(cfg, name, device)
        if step_s < 0:
            raise ValueError(f"step_s={step_s}: a decode step cannot take negative time")
        self.step_s, self.lengths = step_s, lengths
        self.slots = slots or cfg.maker.max_running or cfg.maker.batch_size
        self.cap, self.group_size = cfg.maker.max_new_tokens, cfg.maker.samples_per_prompt
        self.stop_ids = stop_token_ids(self.tokenizer, self.actor)
        self.rng = random.Random(f"{seed}/{name}")
        self.log = DeviceLog(None if log_dir is None else Path(log_dir) / f"{name}.json")

    def draw_length(self) -> int:
        """The next answer's length."""
        return self.lengths.draw(self.rng, self.cap)

    @property
    def batcher_class(self):
        """What the streaming worker builds its batcher with (``MakerWorker._stream``)."""
        return functools.partial(SimulatedBatcher, step_s=self.step_s, draw=self.draw_length, log=self.log)

    def make_experience(self, prompt_ids: list[list[int]], policy_version: int, kl_coef: float | None = None,
                        prompts: Sequence | None = None):
        k = self.group_size
        lengths = [self.draw_length() for _ in range(len(prompt_ids) * k)]
        waited = 0.0
        for i in range(0, len(lengths), self.slots):
            chunk = lengths[i:i + self.slots]
            start = time.perf_counter()
            time.sleep(max(chunk) * self.step_s)
            slept = time.perf_counter() - start
            waited += slept
            self.log.add(sequences=len(chunk), tokens=sum(chunk), steps=max(chunk), slot_steps=sum(chunk), slept_s=slept)
        self.batches += 1
        items = [self._item(prompt_ids[j // k], [5] * n, [policy_version] * n, n == self.cap, j,
                            None if prompts is None else prompts[j // k])
                 for j, n in enumerate(lengths)]
        return items, MakeStats(num_samples=len(items), num_tokens=sum(lengths), generate_s=waited)

    def experience_of(self, finished: Sequence[Finished], kl_coef: float | None = None,
                      prompts: Sequence | None = None):
        """Items of sequences the ``SimulatedBatcher`` finished, in order (``ExperienceMaker.experience_of``)."""
        start = time.perf_counter()
        self.batches += 1
        items = [self._item(f.prompt, f.tokens, f.versions, not f.stopped, i, None if prompts is None else prompts[i])
                 for i, f in enumerate(finished)]
        return items, MakeStats(num_samples=len(items), num_tokens=sum(len(f.tokens) for f in finished),
                                score_s=time.perf_counter() - start)

    def _item(self, prompt, tokens: list[int], versions: list[int], truncated: bool, i: int, text) -> ExperienceItem:
        runs = Finished(None, [], [], [], list(versions), False, 0).version_runs
        return ExperienceItem.filled(torch.as_tensor(prompt), torch.tensor(tokens), reward=0.0,
                                     policy_version=min(versions), uid=f"{self.name}-{self.batches}-{i}",
                                     prompt=text, truncated=truncated,
                                     version_runs=tuple(runs) if len(runs) > 1 else None)


class SleepyEnv(TwoTurnEnv):
    """``ray_ppo.tasks.turns.TwoTurnEnv`` whose every step first sleeps (``asyncio.sleep``, as an
    environment awaiting I/O) a uniformly random ``sleep_s`` range: 50-200 ms."""

    sleep_s: tuple[float, float] = (0.05, 0.2)

    async def step(self, response: str) -> Turn:
        await asyncio.sleep(random.uniform(*self.sleep_s))
        return await super().step(response)


class FaultyEnv(SleepyEnv):
    """``SleepyEnv``, except on prompts whose first digit is 0 (the step raises), 1 (it hangs for an
    hour) or 2 (it returns a string, not a ``Turn``): the three faults an episode must survive."""

    async def step(self, response: str):
        first = prompt_text(self.prompt).split()[0]
        if first == "0":
            raise RuntimeError("the environment broke")
        if first == "1":
            await asyncio.sleep(3600)
        if first == "2":
            return "garbage"
        return await super().step(response)


async def faulty_agent(prompt, endpoint):
    """``ray_ppo.tasks.turns.two_turn_agent`` whose tool steps sleep 50-200 ms, except on prompts whose
    first digit is 0 (it raises after its first call), 1 (it hangs for an hour), 2 (it returns a
    string, not a reward) or 4 (it edits the history: its second call drops the first answer)."""
    client = endpoint.async_client()
    text = prompt_text(prompt)
    first = text.split()[0]
    messages, rewards = [{"role": "user", "content": text}], []
    for _ in range(2):
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
        answer = reply.choices[0].message.content or ""
        if first == "0":
            raise RuntimeError("the agent broke")
        if first == "1":
            await asyncio.sleep(3600)
        rewards.append(0.5 * toy_reward([prompt], [answer])[0])
        kept = [] if first == "4" else [{"role": "assistant", "content": answer}]
        messages += [*kept, {"role": "user", "content": text}]
        await asyncio.sleep(random.uniform(0.05, 0.2))
    return "garbage" if first == "2" else rewards


def coordinator_config(num_ranks: int = 1, num_makers: int = 1, buffer_size: int = 16, max_staleness: int = 1,
                       items_per_version: int = 8, routing: str = "round_robin", prompt_batch_size: int = 16,
                       samples_per_prompt: int = 1, shuffle: bool = True, seed: int = 0,
                       balance: str = "tokens") -> Config:
    """A config whose coordinator (``CoordinatorState.of_config``) has these quantities:
    ``trainer.num_workers`` ranks training ``items_per_version`` items per version between them
    (``trainer.update_steps`` 1), ``maker.num_makers`` makers of ``maker.batch_size`` prompts, and
    so on. Not validated: tests and benchmarks drive a coordinator with buffers smaller than a
    batch, or budgets no run has, which a run's config refuses."""
    if items_per_version % num_ranks:
        raise ValueError(f"items_per_version={items_per_version} is not a multiple of num_ranks={num_ranks}")
    cfg = Config()
    batch = items_per_version // num_ranks
    sections = {
        "trainer": {"num_workers": num_ranks, "update_steps": 1, "train_batch_size": batch, "mini_batch_size": batch},
        "maker": {"num_makers": num_makers, "batch_size": prompt_batch_size, "samples_per_prompt": samples_per_prompt},
        "ppo": {"max_staleness": max_staleness},
        "topology": {"routing": routing, "buffer_size": buffer_size, "balance": balance},
        "data": {"shuffle": shuffle},
    }
    return cfg.model_copy(update={"seed": seed, **{name: getattr(cfg, name).model_copy(update=fields)
                                                   for name, fields in sections.items()}})

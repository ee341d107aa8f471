"""Held-out evaluation of a model on a prompt file: accuracy, mean reward and a few samples.

    result = evaluate(cfg, model="runs/x", data="eval.jsonl", num_prompts=100)
    print(result.line())   # "eval: accuracy 0.420 (42/100 prompts) | reward 0.420 | greedy | model ... | data ..."

``ray-ppo eval MODEL --data FILE`` runs it from the command line. ``MODEL`` is a run directory
(its latest checkpoint's actor), a checkpoint directory (its ``actor/``), a model directory, or
any name ``model.pretrained`` takes (``tiny``, ``smollm2-135m-instruct``, a hub name). The
responses are scored by the config's rule reward (``model.reward_fn``), called as a run calls it;
a response is correct when its reward is at least ``CORRECT``. Greedy by default (one response a
prompt); with ``samples_per_prompt=k`` sampled at the config's sampling settings, reporting
mean@k (the reward's mean) and pass@k (the share of prompts with a correct response). With an
environment (``env.cls``) each answer is an episode (``ray_ppo.makers.episodes``), scored by the
environment's rewards, and the sample's response is the whole exchange.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ray_ppo.config import Config, ConfigError
from ray_ppo.data import Prompt, PromptEncoder, read_prompt_texts
from ray_ppo.outputs.evals import EvalReport

CORRECT = 1.0
"""A response whose reward is at least this counts as correct."""
SHOWN_SAMPLES = 3


@dataclass
class EvalResult:
    model: str
    data: str
    num_prompts: int
    samples_per_prompt: int
    greedy: bool
    accuracy: float
    """Share of responses that are correct (with k > 1 samples: over all k x prompts)."""
    reward_mean: float
    pass_at_k: float
    """Share of prompts with at least one correct response (= accuracy for one response a prompt)."""
    samples: list[dict] = field(default_factory=list)
    """The first few prompts with their response and reward."""

    def line(self) -> str:
        correct = round(self.accuracy * self.num_prompts * self.samples_per_prompt)
        k = self.samples_per_prompt
        how = "greedy" if self.greedy else f"sampled, k={k}, pass@{k} {self.pass_at_k:.3f}"
        return (f"eval: accuracy {self.accuracy:.3f} ({correct}/{self.num_prompts * k} responses) | reward "
                f"{self.reward_mean:.3f} | {how} | model {self.model} | data {self.data}")

    def to_dict(self) -> dict:
        return asdict(self)

    def report(self, step: int, policy_version: int, maker_id: int, eval_s: float) -> EvalReport:
        """This result as the evaluation of the weights of ``step`` during a run."""
        return EvalReport(step=step, policy_version=policy_version, maker_id=maker_id, eval_s=eval_s,
                          accuracy=self.accuracy, reward_mean=self.reward_mean, pass_at_k=self.pass_at_k,
                          num_prompts=self.num_prompts, greedy=self.greedy,
                          samples_per_prompt=self.samples_per_prompt, samples=tuple(self.samples))


def resolve_model(model: str) -> str:
    """The model directory ``model`` stands for: a run directory's latest checkpoint's actor, a
    checkpoint's actor, or what ``model.pretrained`` would resolve it to."""
    from ray_ppo.models import resolve_pretrained

    path = Path(model).expanduser()
    for candidate in (path / "checkpoint" / "actor", path / "actor"):
        if (candidate / "config.json").is_file():
            return str(candidate.resolve())
    return resolve_pretrained(model)


RUN_CONFIG = "config.yaml"


def run_config_of(model: str) -> Path | None:
    """The ``config.yaml`` of the run ``model`` belongs to (a run directory, its ``checkpoint``
    link or one of its ``checkpoints/step_N``), or None for a model outside a run."""
    path = Path(model).expanduser()
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / RUN_CONFIG).is_file() and (candidate / "metrics.jsonl").exists():
            return candidate / RUN_CONFIG
    return None


@dataclass(frozen=True)
class EvalSetup:
    """What ``ray-ppo eval`` evaluates and how: the model, the config it was read from, the prompts,
    the reward and the sampling settings. A run's model is evaluated as the run evaluated it: with
    the run's ``config.yaml`` (``--config`` and overrides on top) and its ``eval`` section's file,
    prompt count, reward, decoding and answer length, each replaced by what the command line gives."""

    cfg: Config
    config_file: str | None
    """The config file read: ``--config``, else the run's ``config.yaml``; None: the defaults."""
    model: str
    data: str | None
    num_prompts: int | None
    greedy: bool
    samples_per_prompt: int
    reward_fn: str | None
    max_new_tokens: int

    @classmethod
    def of(cls, model: str, config: str | None = None, overrides: Sequence[str] = (), data: str | None = None,
           num_prompts: int | None = None, samples: int | None = None) -> EvalSetup:
        from ray_ppo.config import load_config

        run_config = run_config_of(model)
        config_file = config or (str(run_config) if run_config else None)
        cfg = load_config(config_file, overrides)
        e = cfg.eval
        data = data or e.path or cfg.data.path
        if num_prompts is None and e.path and data == e.path:
            num_prompts = e.num_prompts  # the run's own evaluation set, as the run answered it
        greedy = e.greedy if samples is None else False
        k = e.samples_per_prompt if samples is None else samples
        return cls(cfg, config_file, model, data, num_prompts, greedy, k, cfg.eval_reward_fn,
                   e.max_new_tokens or cfg.maker.max_new_tokens)

    @functools.cached_property
    def model_path(self) -> str:
        """The model directory ``model`` stands for (``resolve_model``: a packaged model is converted,
        a GGUF file hashed), resolved once for the checks, the first line and the evaluation."""
        return resolve_model(self.model)

    def check(self) -> None:
        """Pre-flight, as ``ray-ppo train`` has it: the model, its tokenizer, the prompt file, the
        reward function (on a probe batch of the file's prompts) and the environment, each failure
        a ``PreflightError`` of one line."""
        from ray_ppo.config import preflight

        check_eval_model(self.model, lambda: self.model_path)
        cfg = self.cfg
        tokenizer_path = _tokenizer_source(cfg, self.model_path)
        tokenizer = preflight.load_tokenizer_checked("the model", tokenizer_path)
        if not self.data:
            raise preflight.PreflightError("nothing to evaluate on: give a prompt file with --data FILE (or set "
                                           "eval.path or data.path in --config)")
        found = preflight.probe_prompts(self.data, cfg.data.format, cfg.data.prompt_column, "--data")
        preflight.check_chat_messages(tokenizer, tokenizer_path, found, self.data, "--data")
        if cfg.env.cls:
            preflight.check_env(cfg.env, found, tokenizer, tokenizer_path)
        if cfg.agent.fn:
            preflight.load_agent_checked(cfg.agent.fn)
        if not self.reward_fn:
            raise preflight.PreflightError("scoring the answers needs a rule reward: give --config of the run, or "
                                           "set model.reward_fn=module:function (e.g. ray_ppo.tasks.arithmetic:reward)")
        preflight.check_reward_fn(self.reward_fn, found, "eval.reward_fn" if cfg.eval.reward_fn else "model.reward_fn")

    def line(self) -> str:
        """One line: which model, config, prompts, reward and sampling settings the evaluation uses."""
        m = self.cfg.maker
        how = "greedy" if self.greedy else (f"sampled k={self.samples_per_prompt}, temperature {m.temperature:g}, "
                                            f"top_p {m.top_p:g}, top_k {m.top_k}")
        prompts = f"first {self.num_prompts} of " if self.num_prompts else ""
        config = self.config_file or "the defaults (no --config, not a run directory)"
        return (f"eval: model {self.model} ({self.model_path}) | config {config} | prompts {prompts}"
                f"{self.data} | reward {self.reward_fn} | {how}, max_new_tokens {self.max_new_tokens}")


def check_eval_model(model: str, resolved: Callable[[], str]) -> None:
    """``model`` is a run directory with a checkpoint, a checkpoint, a model directory or a model
    name whose ``config.json`` loads (at ``resolved()``, its ``resolve_model``); a ``PreflightError``
    of one line otherwise."""
    from transformers import AutoConfig

    from ray_ppo.config.preflight import PreflightError, _first_line, _local_looking
    from ray_ppo.models.gguf import ModelSourceError

    kinds = "a run directory, a checkpoint directory (with actor/), a model directory (with config.json) or a model name"
    path = Path(model).expanduser()
    if run_config_of(model) == path / RUN_CONFIG and not (path / "checkpoint" / "actor").is_dir():
        raise PreflightError(f"{model!r} is a run directory without a checkpoint (trainer.checkpoint_every=0, or "
                             f"it stopped before its first); give {kinds}")
    if _local_looking(model) and not path.exists():
        raise PreflightError(f"{model!r} does not exist; give {kinds}")
    if path.is_dir() and not any((path / p).exists() for p in ("config.json", "actor", "checkpoint")):
        raise PreflightError(f"{model!r} is not a model: it holds no config.json, actor/ or checkpoint/; give {kinds}")
    try:
        AutoConfig.from_pretrained(resolved())
    except ModelSourceError as e:
        raise PreflightError(f"{model!r}: {e}") from None
    except Exception as e:  # OSError, ValueError, hub errors: the first line is the reason
        raise PreflightError(f"{model!r} cannot be loaded ({_first_line(e)}); give {kinds}") from None


def _tokenizer_source(cfg: Config, path: str) -> str:
    """Where the tokenizer of the model at ``path`` is: beside it, else the config's."""
    if (Path(path) / "tokenizer_config.json").is_file():
        return path
    return cfg.model.tokenizer or cfg.model.pretrained


def evaluate(cfg: Config, model: str | None = None, data: str | None = None, num_prompts: int | None = None,
             samples_per_prompt: int = 1, greedy: bool = True, reward_fn: str | None = None,
             max_new_tokens: int | None = None) -> EvalResult:
    """Generate for the first ``num_prompts`` prompts of ``data`` (default ``data.path``) with
    ``model`` (default ``model.pretrained``) and score the responses with ``reward_fn`` (default
    ``model.reward_fn``)."""
    data = data or cfg.data.path
    if not data:
        raise ConfigError("nothing to evaluate on: give a prompt file (ray-ppo eval --data FILE, or data.path)")
    model = model or cfg.model.pretrained
    return _evaluate_at(cfg, resolve_model(model), model, data, num_prompts, samples_per_prompt, greedy,
                        reward_fn or cfg.model.reward_fn, max_new_tokens)


def evaluate_setup(setup: EvalSetup) -> EvalResult:
    """``evaluate`` as ``setup`` says, with the model it resolved."""
    return _evaluate_at(setup.cfg, setup.model_path, setup.model, setup.data, setup.num_prompts,
                        setup.samples_per_prompt, setup.greedy, setup.reward_fn, setup.max_new_tokens)


def _evaluate_at(cfg: Config, path: str, model: str, data: str, num_prompts: int | None, samples_per_prompt: int,
                 greedy: bool, reward_fn: str | None, max_new_tokens: int | None) -> EvalResult:
    """``evaluate`` of the model directory ``path``, reported under the name ``model``."""
    from ray_ppo.config.preflight import warn_slow_bfloat16
    from ray_ppo.models import load_actor, load_tokenizer

    if cfg.model.dtype == "bfloat16":
        warn_slow_bfloat16("cpu", "model.dtype='bfloat16'")
    tokenizer = load_tokenizer(_tokenizer_source(cfg, path))
    evaluation = Evaluation(cfg, tokenizer, data, num_prompts, greedy, samples_per_prompt, reward_fn, max_new_tokens)
    return evaluation.run(load_actor(path, cfg.model.dtype).eval(), model=str(model))


class Evaluation:
    """One evaluation set, read and encoded once, that any model (or a maker's vLLM engine) answers.

    Responsibilities: read the first ``num_prompts`` prompts of ``data``, generate ``samples_per_prompt``
    responses a prompt (greedy: one), score them with the rule reward ``reward_fn`` and sum them up
    (``EvalResult``). ``ray-ppo eval`` builds one from its arguments; a maker builds one from the
    ``eval`` section (``of_config``) and answers it with the weights it holds."""

    def __init__(self, cfg: Config, tokenizer, data: str, num_prompts: int | None = None, greedy: bool = True,
                 samples_per_prompt: int = 1, reward_fn: str | None = None, max_new_tokens: int | None = None):
        from ray_ppo.models import load_reward_fn

        if greedy and samples_per_prompt != 1:
            raise ConfigError(f"greedy evaluation gives one response a prompt, not samples_per_prompt={samples_per_prompt}; "
                              f"sample (greedy=False, ray-ppo eval --samples K) for pass@k")
        if not reward_fn:
            raise ConfigError(f"evaluating on {data!r} needs a rule reward: set eval.reward_fn or model.reward_fn")
        prompts = [p for p in read_prompt_texts(data, cfg.data.prompt_column, cfg.data.format) if p is not None]
        self.prompts = prompts[:num_prompts] if num_prompts else prompts
        self.tokenizer, self.data, self.greedy, self.k = tokenizer, data, greedy, samples_per_prompt
        self.encoder = PromptEncoder(tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template)
        self.reward_fn = load_reward_fn(reward_fn)
        self.batch_size = cfg.maker.batch_size
        self.max_running = cfg.maker.max_running  # > 0: the HF model answers through a ContinuousBatcher
        self.sampling = cfg.maker.model_copy(update={"max_new_tokens": max_new_tokens or cfg.maker.max_new_tokens})
        from ray_ppo.makers.build import build_episode_runner

        self.episodes = build_episode_runner(cfg, tokenizer)

    @classmethod
    def of_config(cls, cfg: Config, tokenizer) -> Evaluation:
        """The evaluation the ``eval`` section describes (``eval.path`` must be set)."""
        e = cfg.eval
        return cls(cfg, tokenizer, e.path, e.num_prompts, e.greedy, e.samples_per_prompt, cfg.eval_reward_fn,
                   e.max_new_tokens)

    def run(self, actor=None, engine=None, model: str = "") -> EvalResult:
        """Answer every prompt with ``engine`` (a ``VllmEngine``) if given, else with ``actor``."""
        from ray_ppo.models import stop_token_ids

        ends = stop_token_ids(self.tokenizer, actor)
        rows: list[tuple[Prompt, str, float]] = []
        # Streaming makers answer every prompt in one stream, its slots refilled as answers end.
        size = len(self.prompts) if self._streams(engine) else self.batch_size
        for start in range(0, len(self.prompts), size):
            encoded = self.encoder.encode(self.prompts[start:start + size])
            ids = [i for i in encoded.ids for _ in range(self.k)]
            batch_prompts = [p for p in encoded.prompts for _ in range(self.k)]
            if self.episodes is not None:
                responses, scores = self._episodes(ids, batch_prompts, actor, engine, ends)
            else:
                responses = self._respond(ids, actor, engine, ends)
                scores = (float(r) for r in self.reward_fn(batch_prompts, responses))
            rows += zip(batch_prompts, responses, scores, strict=True)
        return _result(rows, model, str(self.data), self.k, self.greedy)

    @torch.no_grad()
    def _respond(self, prompt_ids: Sequence[Sequence[int]], actor, engine, ends) -> list[str]:
        """Decoded responses (special tokens dropped), each ending at its first end token."""
        rollout = self._generate(prompt_ids, actor, engine, ends)
        return [self.tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in rollout.responses(ends)]

    def _generate(self, prompt_ids: Sequence[Sequence[int]], actor, engine, ends, max_new_tokens: int | None = None):
        from ray_ppo.models import generate

        sampling = self.sampling if max_new_tokens is None else self.sampling.model_copy(
            update={"max_new_tokens": min(max_new_tokens, self.sampling.max_new_tokens)})
        pad = self.tokenizer.pad_token_id
        if engine is not None:
            return engine.generate(prompt_ids, sampling, pad, ends, greedy=self.greedy)
        if self._streams(engine):  # the engine path the maker's experience takes
            from ray_ppo.models.continuous import ContinuousBatcher, Request, rollout_of

            batcher = ContinuousBatcher(actor, sampling, pad, ends, max_running=self.max_running, greedy=self.greedy)
            return rollout_of(batcher.run(Request(i, list(ids)) for i, ids in enumerate(prompt_ids)), pad)[0]
        return generate(actor, prompt_ids, sampling, pad, ends, greedy=self.greedy)

    def _streams(self, engine) -> bool:
        """Whether the HF model answers through a ``ContinuousBatcher`` (``maker.max_running`` > 0)."""
        return engine is None and self.max_running > 0

    @torch.no_grad()
    def _episodes(self, prompt_ids, prompts, actor, engine, ends) -> tuple[list[str], list[float]]:
        """Each prompt answered in an episode: (the decoded exchanges, the episodes' rewards). With
        ``maker.max_running``, the episodes stream turn by turn through a ``ContinuousBatcher``, as a
        streaming maker's do (``EpisodeStream``)."""
        if self._streams(engine):
            from ray_ppo.models.continuous import ContinuousBatcher

            batcher = ContinuousBatcher(actor, self.sampling, self.tokenizer.pad_token_id, ends,
                                        max_running=self.max_running, greedy=self.greedy)
            episodes = self.episodes.stream(self.sampling.max_new_tokens).run(batcher, prompt_ids, prompts)
        else:
            def sample(contexts, max_new_tokens):
                return self._generate(contexts, actor, engine, ends, max_new_tokens).responses(ends)

            episodes = self.episodes.run(prompt_ids, prompts, sample).episodes
        return ([self.tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes],
                [e.reward for e in episodes])


def _result(rows: list[tuple[Prompt, str, float]], model: str, data: str, k: int, greedy: bool) -> EvalResult:
    if not rows:
        raise ConfigError(f"no usable prompt in {data!r} to evaluate on")
    correct = [reward >= CORRECT for _, _, reward in rows]
    per_prompt = [any(correct[i:i + k]) for i in range(0, len(rows), k)]
    samples = [{"prompt": p, "response": r, "reward": w} for p, r, w in rows[:SHOWN_SAMPLES * k:k]]
    return EvalResult(model=model, data=data, num_prompts=len(per_prompt), samples_per_prompt=k, greedy=greedy,
                      accuracy=sum(correct) / len(rows), reward_mean=sum(w for _, _, w in rows) / len(rows),
                      pass_at_k=sum(per_prompt) / len(per_prompt), samples=samples)

"""Held-out evaluation of a model on a prompt file: accuracy, mean reward and a few samples.

    result = evaluate(cfg, model="runs/x", data="eval.jsonl", num_prompts=100)
    print(result.line())   # "eval: accuracy 0.420 (42/100 prompts) | reward 0.420 | greedy | model ... | data ..."

``ray-ppo eval MODEL --data FILE`` runs it from the command line. ``MODEL`` is a run directory
(its latest checkpoint's actor), a checkpoint directory (its ``actor/``), a model directory, or
any name ``model.pretrained`` takes (``tiny``, ``smollm2-135m-instruct``, a hub name). The
responses are scored by the config's rule reward (``model.reward_fn``), called as a run calls it;
a response is correct when its reward is at least ``CORRECT``. Greedy by default (one response a
prompt); with ``samples_per_prompt=k`` sampled at the config's sampling settings, reporting
mean@k (the reward's mean) and pass@k (the share of prompts with a correct response).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ray_ppo.config import Config, ConfigError
from ray_ppo.data import Prompt, PromptEncoder, read_prompt_texts

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


def resolve_model(model: str) -> str:
    """The model directory ``model`` stands for: a run directory's latest checkpoint's actor, a
    checkpoint's actor, or what ``model.pretrained`` would resolve it to."""
    from ray_ppo.core.models import resolve_pretrained

    path = Path(model).expanduser()
    for candidate in (path / "checkpoint" / "actor", path / "actor"):
        if (candidate / "config.json").is_file():
            return str(candidate.resolve())
    return resolve_pretrained(model)


def evaluate(cfg: Config, model: str | None = None, data: str | None = None, num_prompts: int | None = None,
             samples_per_prompt: int = 1, greedy: bool = True) -> EvalResult:
    """Generate for the first ``num_prompts`` prompts of ``data`` (default ``data.path``) with
    ``model`` (default ``model.pretrained``) and score the responses with ``model.reward_fn``."""
    from ray_ppo.core.models import load_actor, load_reward_fn, load_tokenizer

    if greedy and samples_per_prompt != 1:
        raise ConfigError(f"greedy evaluation gives one response a prompt, not samples_per_prompt={samples_per_prompt}; "
                          f"sample (greedy=False, ray-ppo eval --samples K) for pass@k")
    data = data or cfg.data.path
    if not data:
        raise ConfigError("nothing to evaluate on: give a prompt file (ray-ppo eval --data FILE, or data.path)")
    path = resolve_model(model or cfg.model.pretrained)
    has_tokenizer = (Path(path) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(path if has_tokenizer else (cfg.model.tokenizer or cfg.model.pretrained))
    actor = load_actor(path, cfg.model.dtype).eval()
    prompts = [p for p in read_prompt_texts(data, cfg.data.prompt_column, cfg.data.format) if p is not None]
    prompts = prompts[:num_prompts] if num_prompts else prompts
    encoder = PromptEncoder(tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template)
    reward_fn = load_reward_fn(cfg.model.reward_fn)
    rows: list[tuple[Prompt, str, float]] = []
    for start in range(0, len(prompts), cfg.maker.batch_size):
        encoded = encoder.encode(prompts[start:start + cfg.maker.batch_size])
        ids = [i for i in encoded.ids for _ in range(samples_per_prompt)]
        batch_prompts = [p for p in encoded.prompts for _ in range(samples_per_prompt)]
        responses = respond(actor, tokenizer, ids, cfg, greedy)
        rows += zip(batch_prompts, responses, (float(r) for r in reward_fn(batch_prompts, responses)), strict=True)
    return _result(rows, str(model or cfg.model.pretrained), str(data), samples_per_prompt, greedy)


@torch.no_grad()
def respond(actor, tokenizer, prompt_ids: Sequence[Sequence[int]], cfg: Config, greedy: bool) -> list[str]:
    """Decoded responses (special tokens dropped) to left-padded prompts, each ending at its first end token."""
    from ray_ppo.core.models import left_pad, response_mask, stop_token_ids

    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    sampling = {} if greedy else {"temperature": cfg.maker.temperature, "top_k": cfg.maker.top_k or None,
                                  "top_p": cfg.maker.top_p}
    ends = stop_token_ids(tokenizer, actor)
    out = actor.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=cfg.maker.max_new_tokens,
                         do_sample=not greedy, pad_token_id=tokenizer.pad_token_id, eos_token_id=list(ends), **sampling)
    responses = out[:, input_ids.shape[1]:]
    mask = response_mask(responses, list(ends))
    return [tokenizer.decode(row[keep], skip_special_tokens=True) for row, keep in zip(responses, mask, strict=True)]


def _result(rows: list[tuple[Prompt, str, float]], model: str, data: str, k: int, greedy: bool) -> EvalResult:
    if not rows:
        raise ConfigError(f"no usable prompt in {data!r} to evaluate on")
    correct = [reward >= CORRECT for _, _, reward in rows]
    per_prompt = [any(correct[i:i + k]) for i in range(0, len(rows), k)]
    samples = [{"prompt": p, "response": r, "reward": w} for p, r, w in rows[:SHOWN_SAMPLES * k:k]]
    return EvalResult(model=model, data=data, num_prompts=len(per_prompt), samples_per_prompt=k, greedy=greedy,
                      accuracy=sum(correct) / len(rows), reward_mean=sum(w for _, _, w in rows) / len(rows),
                      pass_at_k=sum(per_prompt) / len(per_prompt), samples=samples)

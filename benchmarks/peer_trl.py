"""Peer: TRL's PPOTrainer (trl 1.12.0, the last release with PPO) vs ours, synchronous and detached.

    make bench-peer          # creates .venv-trl, then runs this script
    python benchmarks/peer_trl.py [--repeats 3] [--first-seed 1] [--samples 2048] [--skip 4]
                                  [--trl-python .venv-trl/bin/python]

Same tiny model (``ensure_tiny_model("lm")``: policy, reference, and the backbone of the value
model), same toy reward (``ray_ppo.tasks.toy.reward``), same prompts (``data/toy_prompts.csv``),
64 prompts per generation batch, 64 samples per PPO update, one PPO epoch, one minibatch,
8 response tokens stopping at EOS, temperature 1, learning rate 1e-3, KL coefficient 0.001,
clip ranges 0.2, gamma = lambda = 1, constant learning rate, one torch thread per process.

Variants, each in a long-lived process of its own (TRL's in ``--trl-python``, ours in this
interpreter), driven one at a time and interleaved (every variant once per round):
  trl            TRL's ``PPOTrainer.train()`` as shipped
  trl+gc.freeze  the same, with ``gc.freeze()`` right before ``train()`` (``gc.unfreeze()`` after)
  ours sync      ``ray_ppo.local.run_local``: one process, generate -> score -> update
  ours detached  ``ray_ppo.api.PPOTrainer.fit`` on a local Ray cluster: 1 maker, 1 trainer worker
and two diagnostic variants, only when named in ``--variants``:
  ours sync+trl mask  ``run_local`` training, as TRL's loop does, only on the response tokens before
                 the first ``<pad>`` (``trl_loss_mask``); the reward still scores the whole response
  trl+gc.freeze+pad ends  ``trl+gc.freeze`` whose reward reads each response only up to its first
                 ``<pad>`` (``toy_reward_model(pad_ends=True)``): ours' episode, in TRL's loop

TRL's loop takes the first pad token of a response as its end (``sequence_lengths`` in
TRL's ``PPOTrainer.train()``), also a pad the policy sampled itself: the tiny tokenizer's ``<pad>`` is one
of its 13 tokens (and not its EOS), so TRL's loss, value loss and whitening stop at it, while its
generation goes on to the first EOS and its reward scores the whole response. Ours ends the
response at a sampled pad (the pad is one of a maker's end tokens, ``stop_token_ids``), so its
reward scores the response up to the pad. ``ours sync+trl mask`` is ours with TRL's loss mask
(which now only leaves a final sampled pad out of the loss); ``trl+gc.freeze+pad ends`` is TRL with
ours' episode (its loss already stops at the first pad; now its reward does too).
``--pad-is-eos`` makes both sides alike instead: every variant loads a copy of the tiny model
whose tokenizer pads with its EOS (the usual set-up of GPT-2-style tokenizers), so a sampled pad
is an EOS, where TRL's loop and ours both end the response.

TRL needs a reward *model*: its ``get_reward`` runs ``getattr(model, model.base_model_prefix)``
on the padded query+response and reads ``model.score(hidden_states[-1])`` at the last non-pad
token. ``ToyRewardModel`` below is an ``nn.Module`` of that shape whose "backbone" decodes the
sequences and returns the toy rule reward as a one-channel hidden state at every position, and
whose ``score`` is the identity, so TRL reads exactly ``toy.reward(prompt, response)``; every
TRL run first checks that through TRL's own ``get_reward`` (``check_reward_model``).

Start-up is excluded: process start, imports and the Ray cluster happen once per process,
before a short warm-up run (all variants' warm-ups at once, unmeasured); in each run, model
loading and trainer construction (and for the detached run the coordinator, maker and Ray Train
worker start) come before the first update, and the clock runs from the end of update
``--skip`` to the end of the last update (TRL: a ``TrainerCallback.on_step_end``; sync:
``run_local``'s per-step callback; detached: the trainer's per-step ``elapsed_s``).
Reward: mean toy reward of the samples of the last ``--reward-updates`` updates of a run (the
policy's own samples, temperature 1).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
from _common import median, publish, tiny_config
from ray_ppo.cluster.async_search import sign_flip_p

VARIANTS = ("trl", "trl+gc.freeze", "ours sync", "ours detached")
TRL_VARIANTS = ("trl", "trl+gc.freeze", "trl+gc.freeze+pad ends")
DIAGNOSTIC_VARIANTS = ("ours sync+trl mask", "trl+gc.freeze+pad ends")
BATCH = 64
"""Prompts per generation batch = samples per PPO update = minibatch size, on every side."""
RESPONSE_LEN = 8
LR = 1e-3
KL_COEF = 0.001
CLIP = 0.2
PROMPTS = _common.ROOT / "data" / "toy_prompts.csv"
PAD_IS_EOS = False
"""``--pad-is-eos``: every variant loads ``tiny_model_path()``'s copy whose tokenizer pads with EOS."""


def tiny_model_path() -> str:
    """The tiny model every variant loads: ``ensure_tiny_model("lm")``, or with ``PAD_IS_EOS`` a
    copy of it (built once, next to it) whose tokenizer and config take EOS as the pad token."""
    import json
    import shutil

    from ray_ppo.models import ensure_tiny_model, load_tokenizer
    from ray_ppo.models.cache import build_once

    source = ensure_tiny_model("lm")
    if not PAD_IS_EOS:
        return str(source)

    def copy_with_eos_pad(directory: Path) -> None:
        shutil.copytree(source, directory, dirs_exist_ok=True)
        tokenizer = load_tokenizer(str(source))
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(str(directory))
        config = json.loads((directory / "config.json").read_text())
        config["pad_token_id"] = tokenizer.eos_token_id
        (directory / "config.json").write_text(json.dumps(config, indent=2))

    return str(build_once(source.parent / "tiny-lm-pad-is-eos", copy_with_eos_pad))


RESULT_PREFIX = "RESULT "


# -- timing shared by every variant --------------------------------------------------------------

class GcClock:
    """Seconds spent in the garbage collector of this process, from ``gc.callbacks``."""

    def __init__(self):
        self.events: list[tuple[float, float]] = []  # (start, duration)
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.events.append((self._start, now - self._start))

    def seconds_between(self, t0: float, t1: float) -> float:
        return sum(d for s, d in self.events if t0 <= s <= t1)


def summarize(step_ends: list[float], rewards: list[float], skip: int, reward_updates: int,
              gc_s: float | None = None) -> dict:
    """Throughput from per-update end times (updates after ``skip``) and reward of the last updates."""
    window = step_ends[-1] - step_ends[skip - 1]
    samples = BATCH * (len(step_ends) - skip)
    return {"samples_per_s": samples / window, "timed_s": window,
            "reward_end": sum(rewards[-reward_updates:]) / reward_updates,
            "reward_first": rewards[0], "updates": len(step_ends),
            "gc_share": None if gc_s is None else gc_s / window}


# -- TRL -----------------------------------------------------------------------------------------

def toy_reward_model(tokenizer, prompt_width: int, pad_ends: bool = False):
    """TRL reward model that scores with the toy rule (see the module docstring).

    Its ``batch_means`` list gets the mean toy reward of every batch it scores. With ``pad_ends`` a
    response ends at its first pad token (a sampled one too, as ours' makers end it): the tokens
    after it are not scored.
    """
    import torch
    from torch import nn
    from transformers.utils import ModelOutput

    from ray_ppo.tasks.toy import reward

    class ToyScorer(nn.Module):
        """Decodes prompt (first ``prompt_width`` tokens) and response; returns (B, T, 1) scores."""

        def __init__(self, batch_means: list[float]):
            super().__init__()
            self.batch_means = batch_means

        def forward(self, input_ids, attention_mask, **_):
            ids = input_ids.masked_fill(attention_mask == 0, tokenizer.pad_token_id)
            prompts = tokenizer.batch_decode(ids[:, :prompt_width], skip_special_tokens=True)
            response = ids[:, prompt_width:]
            if pad_ends:
                response = cut_at_first_pad(response, tokenizer.pad_token_id)
            responses = tokenizer.batch_decode(response, skip_special_tokens=True)
            scores = torch.tensor(reward(prompts, responses), dtype=torch.float32)
            self.batch_means.append(float(scores.mean()))
            return ModelOutput(hidden_states=(scores[:, None, None].expand(-1, ids.shape[1], 1),))

    class ToyRewardModel(nn.Module):
        base_model_prefix = "scorer"

        def __init__(self):
            super().__init__()
            self.batch_means: list[float] = []
            self.scorer, self.score = ToyScorer(self.batch_means), nn.Identity()

    return ToyRewardModel()


def cut_at_first_pad(response, pad_token_id: int):
    """``response`` (B, T) with every token from the first pad token on set to the pad: the pad
    ends it, as a maker's ``response_mask`` with the pad among its end ids reads it."""
    from ray_ppo.models import response_mask

    return response.masked_fill(~response_mask(response, pad_token_id), pad_token_id)


def trl_dataset(tokenizer):
    """The toy prompts tokenized for TRL, and their common token width (every toy prompt has one)."""
    from datasets import Dataset

    from ray_ppo.data import read_prompt_texts

    ids = [tokenizer(text)["input_ids"] for text in read_prompt_texts(str(PROMPTS), "prompt")]
    widths = {len(x) for x in ids}
    if len(widths) != 1:
        raise SystemExit(f"ToyRewardModel needs prompts of one token width; {PROMPTS} has {sorted(widths)}")
    return Dataset.from_dict({"input_ids": ids}), widths.pop()


def check_reward_model(reward_model, tokenizer, queries: list[list[int]], width: int, pad_ends: bool) -> None:
    """TRL's own ``get_reward`` on ``reward_model`` returns exactly ``toy.reward``, also for responses
    that TRL truncated after an EOS, for responses with a pad inside (scored up to it with
    ``pad_ends``) and for perfect answers."""
    import torch
    from trl.experimental.ppo.ppo_trainer import truncate_response
    from trl.experimental.utils import get_reward

    from ray_ppo.tasks.toy import reward

    query = torch.tensor(queries)
    rng = torch.Generator().manual_seed(0)
    response = torch.randint(0, len(tokenizer), (len(queries), RESPONSE_LEN), generator=rng)
    response[::4] = query[::4, -1:]  # every 4th row repeats its prompt's last digit: reward 1
    response[1::4, 2] = tokenizer.pad_token_id  # a sampled pad inside every 4th row (from the 2nd)
    response[1::4, 3:] = query[1::4, -1:]  # right answers after it: scored only without pad_ends
    response = truncate_response(tokenizer.eos_token_id, tokenizer.pad_token_id, response)
    _, score, _ = get_reward(reward_model, torch.cat([query, response], 1), tokenizer.pad_token_id, width)
    scored = cut_at_first_pad(response, tokenizer.pad_token_id) if pad_ends else response
    expected = reward(tokenizer.batch_decode(query, skip_special_tokens=True),
                      tokenizer.batch_decode(scored, skip_special_tokens=True))
    if not torch.equal(score, torch.tensor(expected)):
        raise SystemExit(f"ToyRewardModel through TRL's get_reward != toy.reward: {score.tolist()} vs {expected}")
    reward_model.batch_means.clear()


def trl_run(seed: int, samples: int, skip: int, reward_updates: int, freeze: bool, gc_clock: GcClock,
            pad_ends: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from ray_ppo.models import load_tokenizer

    path = tiny_model_path()
    tokenizer = load_tokenizer(path)
    dataset, width = trl_dataset(tokenizer)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    gc.collect()
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as out:
        args = PPOConfig(
            output_dir=out, seed=seed, total_episodes=samples, per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1,
            local_rollout_forward_batch_size=BATCH, response_length=RESPONSE_LEN, stop_token="eos",
            temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", kl_coef=KL_COEF, cliprange=CLIP,
            cliprange_value=CLIP, gamma=1.0, lam=1.0, num_sample_generations=0, bf16=False,
            gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True)
        reward_model = toy_reward_model(tokenizer, width, pad_ends)
        check_reward_model(reward_model, tokenizer, dataset["input_ids"][:BATCH], width, pad_ends)
        trainer = PPOTrainer(
            args=args, processing_class=tokenizer, model=AutoModelForCausalLM.from_pretrained(path),
            ref_model=AutoModelForCausalLM.from_pretrained(path), reward_model=reward_model,
            train_dataset=dataset, value_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1),
            callbacks=[StepClock()])
        if freeze:
            gc.freeze()
        try:
            trainer.train()
        finally:
            gc.unfreeze()
    gc_s = gc_clock.seconds_between(step_ends[skip - 1], step_ends[-1])
    return summarize(step_ends, reward_model.batch_means, skip, reward_updates, gc_s)


# -- ours ----------------------------------------------------------------------------------------

def our_config(seed: int, samples: int, out: str):
    return tiny_config(out, {
        "seed": seed, "data.path": str(PROMPTS), "model.pretrained": tiny_model_path(), "maker.batch_size": BATCH,
        "maker.max_new_tokens": RESPONSE_LEN, "maker.temperature": 1.0,
        "trainer.total_steps": samples // BATCH, "trainer.train_batch_size": BATCH, "trainer.mini_batch_size": BATCH,
        "trainer.ppo_epochs": 1, "trainer.actor_lr": LR, "trainer.critic_lr": LR, "trainer.lr_schedule": "constant",
        "ppo.kl_coef": KL_COEF, "ppo.eps_clip": CLIP, "ppo.value_clip": CLIP, "ppo.gamma": 1.0, "ppo.lam": 1.0})


@contextlib.contextmanager
def trl_loss_mask():
    """Inside: our makers train only on response tokens before the first pad token, as TRL's loop
    does (its ``sequence_lengths``: the first pad of the EOS-truncated response, minus one), pads
    the policy sampled included. Sequences, attention and the reward are left whole (TRL's reward
    model reads the whole response too). One simplification: a response whose first token is a
    pad keeps that token (TRL's loss has none of it; ours needs one token per response)."""
    from ray_ppo.makers import experience
    from ray_ppo.models import Rollout

    sample = experience.generate

    def loss_until_first_pad(model, prompts, params, pad_token_id, eos_token_id, **kwargs):
        rollout = sample(model, prompts, params, pad_token_id, eos_token_id, **kwargs)
        after_pad = (rollout.sequences[:, rollout.prompt_len:] == pad_token_id).long().cumsum(dim=1) > 0
        mask = rollout.action_mask & ~after_pad
        mask[:, 0] = True
        return Rollout(rollout.sequences, rollout.attention_mask, mask, rollout.prompt_len, rollout.log_probs)

    experience.generate = loss_until_first_pad
    try:
        yield
    finally:
        experience.generate = sample


def sync_run(seed: int, samples: int, skip: int, reward_updates: int, gc_clock: GcClock,
             trl_mask: bool = False) -> dict:
    from ray_ppo.local import run_local

    step_ends: list[float] = []
    gc.collect()
    with tempfile.TemporaryDirectory() as out, trl_loss_mask() if trl_mask else contextlib.nullcontext():
        history = run_local(our_config(seed, samples, out), on_metrics=lambda m: step_ends.append(time.perf_counter()))
    gc_s = gc_clock.seconds_between(step_ends[skip - 1], step_ends[-1])
    return summarize(step_ends, [m["reward_mean"] for m in history], skip, reward_updates, gc_s)


def detached_run(seed: int, samples: int, skip: int, reward_updates: int) -> dict:
    from ray_ppo.api import PPOTrainer

    with tempfile.TemporaryDirectory() as out:
        trainer = PPOTrainer(our_config(seed, samples, out))
        trainer.fit()
    history = sorted(trainer.history, key=lambda m: m["step"])
    result = summarize([m["elapsed_s"] for m in history], [m["reward_mean"] for m in history], skip, reward_updates)
    result["staleness"] = median([m["staleness_mean"] for m in history[skip:]])
    return result


# -- worker process: one variant, runs on request ------------------------------------------------

def worker(variant: str) -> None:
    """Serve runs of ``variant``: one JSON request per stdin line, one result line on the real stdout."""
    import torch

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries print to stdout; only results go to the driver's pipe
    torch.set_num_threads(1)
    gc_clock = GcClock()
    if variant == "ours detached":
        _common.init_ray(num_cpus=8)
    for line in sys.stdin:
        req = json.loads(line)
        args = (req["seed"], req["samples"], req["skip"], req["reward_updates"])
        start = time.perf_counter()
        if variant in TRL_VARIANTS:
            result = trl_run(*args, freeze=variant != "trl", gc_clock=gc_clock,
                             pad_ends=variant == "trl+gc.freeze+pad ends")
        elif variant in ("ours sync", "ours sync+trl mask"):
            result = sync_run(*args, gc_clock=gc_clock, trl_mask=variant == "ours sync+trl mask")
        else:
            result = detached_run(*args)
        result["run_s"] = time.perf_counter() - start
        result["untimed_s"] = result["run_s"] - result["timed_s"]
        protocol.write(RESULT_PREFIX + json.dumps(result) + "\n")


class Worker:
    """Driver side of one variant's process; its logs go to ``log_path``."""

    def __init__(self, variant: str, python: str, log_dir: str, response_length: int, pad_is_eos: bool = False):
        self.variant, self.log_path = variant, Path(log_dir) / f"{variant.replace(' ', '_')}.log"
        env = {**os.environ, "PYTHONPATH": str(_common.ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, __file__, "--worker", variant, "--response-length", str(response_length)]
                                     + (["--pad-is-eos"] if pad_is_eos else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def run(self, **request) -> dict:
        self.send(**request)
        return self.receive()

    def send(self, **request) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line.startswith(RESULT_PREFIX):
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"{self.variant} worker failed (exit {self.proc.poll()}); log tail:\n{tail}")
        return json.loads(line[len(RESULT_PREFIX):])

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # end of input: the worker returns
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=120)
        self.log.close()


# -- driver --------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1,
                    help="round k runs seed first-seed + k - 1 (another set of seeds for more rounds)")
    ap.add_argument("--samples", type=int, default=2048, help="samples per run (a multiple of 64)")
    ap.add_argument("--skip", type=int, default=4, help="updates excluded from the timing (start-up)")
    ap.add_argument("--reward-updates", type=int, default=4, help="last updates whose samples give the reward")
    ap.add_argument("--trl-python", default=str(_common.ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--response-length", type=int, default=RESPONSE_LEN,
                    help="response tokens per sample (maker.max_new_tokens; TRL's response_length)")
    ap.add_argument("--pad-is-eos", action="store_true",
                    help="every variant loads a copy of the tiny model whose tokenizer pads with EOS (no sampleable pad)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS + DIAGNOSTIC_VARIANTS]
    if unknown:
        ap.error(f"unknown --variants {', '.join(map(repr, unknown))}; known: {', '.join(VARIANTS + DIAGNOSTIC_VARIANTS)}")
    if args.samples % BATCH or args.samples // BATCH <= max(args.skip, args.reward_updates):
        ap.error(f"--samples must be a multiple of {BATCH} with more updates than --skip and --reward-updates")
    return args


def run_rounds(workers: dict[str, Worker], args) -> dict[str, list[dict]]:
    for w in workers.values():  # warm-up, all variants at once (not measured): lazy imports, first calls
        w.send(seed=0, samples=BATCH * (args.skip + 1), skip=args.skip, reward_updates=1)
    for w in workers.values():
        w.receive()
    runs: dict[str, list[dict]] = {v: [] for v in workers}
    for rep in range(args.repeats):  # interleaved: every variant once per round, same seed in a round
        for variant, w in workers.items():
            runs[variant].append(w.run(seed=args.first_seed + rep, samples=args.samples, skip=args.skip,
                                       reward_updates=args.reward_updates))
            print(f"round {rep + 1} (seed {args.first_seed + rep}) {variant}: {runs[variant][-1]}", file=sys.stderr,
                  flush=True)
    return runs


def report(runs: dict[str, list[dict]], args, wall_s: float) -> None:
    base_variant = next(iter(runs))
    base = median([r["samples_per_s"] for r in runs[base_variant]])
    rows = []
    for variant, rs in runs.items():
        sps = median([r["samples_per_s"] for r in rs])
        rows.append([variant, 1000 / sps, sps, sps / base, median([r["reward_first"] for r in rs]),
                     median([r["reward_end"] for r in rs]), median([r["gc_share"] for r in rs]),
                     median([r["run_s"] for r in rs]), median([r["untimed_s"] for r in rs])])
    print(f"Peer: TRL 1.12.0 PPO vs ray_ppo, tiny GPT-2{' (pad = EOS)' if PAD_IS_EOS else ''}, toy task, batch {BATCH}, "
          f"{RESPONSE_LEN} response tokens, "
          f"{args.samples} samples per run ({args.samples // BATCH} updates, first {args.skip} untimed), median of "
          f"{args.repeats} interleaved runs after a warm-up; script wall time {wall_s / 60:.1f} min\n")
    publish("peer_trl", ["variant", "wall s per 1,000 samples", "samples/s", f"speed vs {base_variant}",
                 "reward, first 64 samples",
                 f"reward, last {args.reward_updates * BATCH} of {args.samples} samples", "gc share of wall",
                 "run wall s", "of which untimed s (start-up, first updates, shutdown)"], rows, args=args)


def paired_reward_difference(base: list[float], other: list[float]) -> dict:
    """``other - base`` reward, paired by round (one seed per round): mean, median, how many rounds
    ``other`` is higher, and the exact two-sided p-value of a sign-flip permutation test of the
    mean difference (``ray_ppo.cluster.async_search.sign_flip_p``)."""
    diffs = [o - b for b, o in zip(base, other, strict=True)]
    return {"mean": sum(diffs) / len(diffs), "median": median(diffs), "higher": sum(d > 0 for d in diffs),
            "rounds": len(diffs), "p": sign_flip_p(diffs)}


def report_rewards(runs: dict[str, list[dict]], args) -> None:
    """Each variant's reward after the run against every variant before it, paired by round."""
    if len(runs) < 2:
        return
    if args.repeats > 16:
        print(f"\nNo paired reward comparison: its exact sign-flip test enumerates 2^n sign patterns, "
              f"which this script does up to 16 rounds (asked: --repeats {args.repeats})")
        return
    rewards = {variant: [r["reward_end"] for r in rs] for variant, rs in runs.items()}
    rows = []
    for base, variant in itertools.combinations(rewards, 2):
        d = paired_reward_difference(rewards[base], rewards[variant])
        rows.append([variant, base, d["mean"], d["median"], f"{d['higher']} of {d['rounds']}", d["p"]])
    print(f"\nReward after {args.samples} samples, paired by round (same seed)\n")
    publish("peer_trl_differences", ["variant", "minus", "mean difference", "median difference", "rounds above",
                 "p (two-sided sign-flip test of the mean)"], rows, args=args)


def main():
    global RESPONSE_LEN, PAD_IS_EOS
    args = parse_args()
    RESPONSE_LEN = args.response_length  # read at run time by the worker's TRL config and ours
    PAD_IS_EOS = args.pad_is_eos
    if args.worker:
        return worker(args.worker)
    variants = args.variants.split(",")
    if any(v in TRL_VARIANTS for v in variants) and not Path(args.trl_python).exists():
        raise SystemExit(f"{args.trl_python} not found: `make bench-peer` creates .venv-trl with trl==1.12.0")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peer_trl-") as log_dir:
        workers = {v: Worker(v, args.trl_python if v in TRL_VARIANTS else sys.executable, log_dir,
                                 args.response_length, args.pad_is_eos) for v in variants}
        try:
            runs = run_rounds(workers, args)
        finally:
            for w in workers.values():
                w.close()
    report(runs, args, time.perf_counter() - start)
    report_rewards(runs, args)


if __name__ == "__main__":
    main()

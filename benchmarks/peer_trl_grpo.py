"""TRL's GRPOTrainer (trl 1.12.0) on the work of configs/smollm2_grpo.yaml: one seed, accuracy against wall time.

    .venv-trl/bin/python benchmarks/peer_trl_grpo.py --output DIR [--config FILE] [key=value ...]

``benchmarks/real_model.py --variants ours trl`` runs it, once a seed, in ``.venv-trl`` (``make
.venv-trl/.installed`` builds it: trl==1.12.0 on .venv's frozen versions), and reads what it writes.
Every setting comes from the same config ray_ppo trains with (``configs/smollm2_grpo.yaml``, with the
same dotted overrides), mapped onto ``GRPOConfig``:

  model           ``model.pretrained``, resolved by ``ray_ppo.models.resolve_pretrained`` (the
                  driver passes the converted SmolLM2 directory: nothing is downloaded) and loaded
                  by ``load_actor`` in ``model.dtype`` (float32), as ours loads it
  prompts         the chat messages of ``data.path``, read by ``ray_ppo.data.read_prompt_texts``;
                  TRL renders them with the tokenizer's chat template, which gives the token ids our
                  ``PromptEncoder`` gives (``check_same_prompt_ids`` checks the first batch)
  reward          ``model.reward_fn`` (``ray_ppo.tasks.arithmetic:reward``) on the decoded completions
  group           ``num_generations = maker.samples_per_prompt`` (4), ``maker.batch_size`` (8) prompts
                  a generation batch: 32 completions, as one of our steps
  updates         ``per_device_train_batch_size = trainer.mini_batch_size`` (16) and
                  ``steps_per_generation = train_batch_size / mini_batch_size`` (2): two optimizer
                  steps on each batch of 32, one epoch (``num_iterations = trainer.ppo_epochs``), as
                  ours; TRL's ``global_step`` counts optimizer steps, so one of our steps is 2 of TRL's
  sampling        ``max_completion_length = maker.max_new_tokens`` (24), ``temperature`` (1), top-p 1, top-k off
  optimizer       AdamW, ``learning_rate = trainer.actor_lr`` (1e-5), constant as ours (TRL's default
                  decays linearly to 0 at ``max_steps``, set from ``trainer.total_steps``, which the
                  wall-clock budget stops long before), no warm-up, no weight decay, gradient norm
                  clipped at ``trainer.max_grad_norm`` (1.0)
  KL              ``beta = ppo.kl_coef`` (0: no KL term on either side)
  clipping        ``epsilon = ppo.eps_clip`` (0.2, TRL's default too), upper bound the same
  budget          ``trainer.time_budget_s`` (900 s) of training, counted from ``on_train_begin``
                  with the evaluations' seconds taken out; the run stops at the first whole step
                  past it (or at ``trainer.total_steps``), then evaluates that last step
  evaluation      ``ray_ppo.makers.evaluation.Evaluation.of_config`` (the ``eval`` section: the 48 held-out
                  level-1 questions, greedy, 24 new tokens, batches of ``maker.batch_size``) on the
                  trainer's model, at step 0, every ``eval.every`` steps and at the last step, from a
                  ``TrainerCallback``; its seconds are measured and excluded from TRL's training time
  threads         one process with ``--threads`` torch threads (default: every core, 2 here); ours
                  runs one maker and one trainer worker with one thread each on the same 2 cores

Where TRL's GRPO, run as shipped, differs from ours (``algo.advantage: grpo``):

- **Loss aggregation**: TRL's default ``loss_type="dapo"`` sums the clipped token losses of an
  optimizer step's 16 completions and divides by half the valid tokens of the whole generation
  batch of 32 (``num_items_in_batch`` rescaled by ``steps_per_generation``); ours
  (``ppo.loss_agg: token_mean``) divides by the valid tokens of the 16 completions themselves. Both
  are token-level (DAPO, Yu et al. 2025, eq. 12): the same up to the two halves' token counts.
- **Advantages** (``scale_rewards="group"``): both (r - group mean) / (group std + eps) with the
  unbiased std; eps is 1e-4 in TRL, 1e-6 in ours. A group of equal rewards gets 0 in both.
- **KL**: no KL term on either side (beta = kl_coef = 0), so neither loads a reference model nor
  reports a KL (ours: ``PPOConfig.uses_reference``).
- **Clipping and off-policy**: TRL is synchronous: it generates with the current weights, keeps the
  generation-time log-probs (``old_per_token_logps``, computed because ``steps_per_generation`` >
  ``gradient_accumulation_steps``) and clips the ratio of its second optimizer step at 0.2 around
  them. Ours is detached: a maker generates while the trainer trains, on weights up to
  ``ppo.max_staleness`` (1) versions old, with the decoupled correction (``ppo.off_policy:
  decoupled``): importance weights from the behaviour policy to the trainer's recomputed proximal
  log-probs (tokens whose weight exceeds ``ppo.decoupled_cap`` dropped), the ratio clipped at
  ``ppo.eps_clip`` around the proximal ones.
- **End of a response**: both end it at the first EOS (``<|im_end|>``, which is also SmolLM2's pad)
  and train on the tokens up to and including it; TRL's ``mask_truncated_completions=False`` (its
  default) trains on responses cut at 24 tokens, as ours does. Ours also ends one at any end id of
  the checkpoint's generation config; SmolLM2's lists only ``<|im_end|>``.
- **Engineering defaults left out**: TRL's ``gradient_checkpointing=True`` (recomputes activations
  in the backward pass to save memory; ours never checkpoints, and a 135 M model needs no saving
  on this machine) is set to False. ``bf16`` follows ``trainer.autocast`` (default false: ours trains
  in float32): TRL's own default, ``bf16=True``, is bfloat16 autocast with float32 weights, as ours
  with ``trainer.autocast=true``, and on a CPU it needs ``use_cpu=True``, which is then set.
  Everything else stays TRL's.
- **Prompt order**: both shuffle the prompts with the run's seed (``shuffle_dataset = data.shuffle``),
  each with its own generator, so the two sides of a seed see the prompts in different orders.

Writes to ``--output``: ``eval.jsonl`` (one row an evaluation: step, training seconds, accuracy,
reward, the evaluation's own seconds, a few samples), ``log.jsonl`` (TRL's logged metrics, every
optimizer step) and ``trl.json`` (the seed, the settings, steps, samples, training and evaluation
seconds, samples/s), which ``benchmarks/real_model.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_grpo.yaml"


def trl_settings(cfg) -> dict:
    """The ``GRPOConfig`` arguments that carry ``cfg``'s work (see the module doc); TRL's own defaults for the rest."""
    import torch

    t = cfg.trainer
    if t.train_batch_size != cfg.maker.batch_size * cfg.maker.samples_per_prompt:
        raise SystemExit(f"trainer.train_batch_size ({t.train_batch_size}) must be maker.batch_size x "
                         f"maker.samples_per_prompt: TRL generates one batch of groups per step")
    steps_per_generation = t.train_batch_size // t.mini_batch_size  # the config checks it divides, in whole groups
    return {
        "seed": cfg.seed, "shuffle_dataset": cfg.data.shuffle, "num_generations": cfg.maker.samples_per_prompt,
        "per_device_train_batch_size": t.mini_batch_size, "gradient_accumulation_steps": 1,
        "steps_per_generation": steps_per_generation, "num_iterations": t.ppo_epochs,
        "max_steps": t.total_steps * steps_per_generation,
        "max_completion_length": cfg.maker.max_new_tokens, "temperature": cfg.maker.temperature,
        "learning_rate": t.actor_lr, "lr_scheduler_type": "constant", "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm, "beta": cfg.ppo.kl_coef, "epsilon": cfg.ppo.eps_clip,
        "gradient_checkpointing": False, "bf16": t.autocast, "use_cpu": t.autocast and not torch.cuda.is_available(),
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
    }


def arithmetic_reward(reward_fn):
    """``reward_fn`` (ours: prompts and response texts) as a TRL reward function (conversational
    completions: one assistant message each)."""
    def reward(prompts, completions, **_):
        return reward_fn(prompts, [c[-1]["content"] if isinstance(c, list) else c for c in completions])
    reward.__name__ = getattr(reward_fn, "__name__", "reward")
    return reward


def check_same_prompt_ids(trainer, encoder, prompts) -> None:
    """TRL's prompt token ids (``_tokenize_prompts``) are ours (``PromptEncoder``) for ``prompts``."""
    theirs, _, _ = trainer._tokenize_prompts(prompts)
    ours = encoder.encode(prompts).ids
    if [list(x) for x in theirs] != [list(x) for x in ours]:
        raise SystemExit(f"TRL and ray_ppo tokenize the prompts differently:\n{theirs[0]}\n{ours[0]}")


def clock_and_eval_callback(cfg, evaluation, out: Path, steps_per_generation: int):
    """A ``TrainerCallback`` that keeps the training clock (without evaluations), evaluates at step 0,
    every ``eval.every`` steps and the last step, and stops at the time budget (module doc)."""
    from transformers import TrainerCallback

    class ClockAndEval(TrainerCallback):
        def __init__(self):
            self.start, self.eval_s, self.step, self.evaluated, self.step_s = 0.0, 0.0, 0, -1, []
            self.eval_log = open(out / "eval.jsonl", "w")
            self.log = open(out / "log.jsonl", "w")

        def train_s(self) -> float:
            return time.perf_counter() - self.start - self.eval_s

        def evaluate(self, model) -> None:
            began, was_training = time.perf_counter(), model.training
            train_s = self.train_s()
            model.eval()
            result = evaluation.run(actor=model, model=cfg.model.pretrained)
            model.train(was_training)
            eval_s = time.perf_counter() - began
            self.eval_s += eval_s
            self.evaluated = self.step
            row = {"step": self.step, "elapsed_s": train_s, "accuracy": result.accuracy,
                   "reward_mean": result.reward_mean, "eval_s": eval_s, "samples": result.samples}
            self.eval_log.write(json.dumps(row) + "\n")
            self.eval_log.flush()
            print(f"[trl] step {self.step} ({train_s:.0f} s): {result.line()}", file=sys.stderr, flush=True)

        def on_train_begin(self, args, state, control, model=None, **_):
            self.start = time.perf_counter()
            self.evaluate(model)

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % steps_per_generation:
                return
            self.step = state.global_step // steps_per_generation
            self.step_s.append(self.train_s())
            if self.train_s() >= cfg.trainer.time_budget_s or self.step >= cfg.trainer.total_steps:
                control.should_training_stop = True
            elif self.step % cfg.eval.every == 0:
                self.evaluate(model)

        def on_log(self, args, state, control, logs=None, **_):
            self.log.write(json.dumps({"global_step": state.global_step, **(logs or {})}) + "\n")

        def on_train_end(self, args, state, control, model=None, **_):
            if self.evaluated != self.step:
                self.evaluate(model)
            self.eval_log.close()
            self.log.close()

    return ClockAndEval()


def run(cfg, out: Path, threads: int) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ray_ppo.data import PromptEncoder, read_prompt_texts
    from ray_ppo.makers.evaluation import Evaluation
    from ray_ppo.models import load_actor, load_reward_fn, load_tokenizer, resolve_pretrained

    torch.set_num_threads(threads)
    path = resolve_pretrained(cfg.model.pretrained)
    tokenizer = load_tokenizer(path)  # ours (left padding), for the evaluation and the prompt check
    prompts = [p for p in read_prompt_texts(cfg.data.path, cfg.data.prompt_column, cfg.data.format) if p is not None]
    settings = trl_settings(cfg)
    callback = clock_and_eval_callback(cfg, Evaluation.of_config(cfg, tokenizer), out,
                                       settings["steps_per_generation"])
    with tempfile.TemporaryDirectory(prefix="trl_grpo-") as scratch:
        trainer = GRPOTrainer(
            model=load_actor(path, cfg.model.dtype), args=GRPOConfig(output_dir=scratch, **settings),
            reward_funcs=arithmetic_reward(load_reward_fn(cfg.model.reward_fn)),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(path), callbacks=[callback])
        check_same_prompt_ids(trainer, PromptEncoder(tokenizer, cfg.data.max_prompt_len, cfg.data.chat_template),
                              prompts[:cfg.maker.batch_size])
        trainer.train()
    train_s = callback.step_s[-1]
    samples = callback.step * cfg.trainer.train_batch_size
    return {"seed": cfg.seed, "model": path, "trl_version": trl.__version__, "threads": threads,
            "settings": settings, "steps": callback.step, "samples": samples, "train_s": train_s,
            "eval_s": callback.eval_s, "samples_per_s": samples / train_s, "step_s": callback.step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for eval.jsonl, log.jsonl and trl.json")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of the TRL process (default: the cores this process may use)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, as ray-ppo's")
    args = parser.parse_args()
    from ray_ppo.config import load_config

    cfg = load_config(args.config, args.overrides)
    args.output.mkdir(parents=True, exist_ok=True)
    result = run(cfg, args.output, args.threads)
    (args.output / "trl.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[trl] seed {result['seed']}: {result['steps']} steps, {result['samples']} samples in "
          f"{result['train_s']:.0f} s of training ({result['samples_per_s']:.2f} samples/s) + "
          f"{result['eval_s']:.0f} s of evaluation", file=sys.stderr)


if __name__ == "__main__":
    main()

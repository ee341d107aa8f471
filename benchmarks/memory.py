"""Peak RSS of a maker process and of a trainer process, tiny and GPT-2-small-shaped models.

    python benchmarks/memory.py [--models tiny,gpt2-small]

Each measurement runs in a fresh subprocess and reports ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
(peak RSS) plus the RSS after the imports (what Python + torch + transformers cost alone).
  maker:   ``MakerWorker`` built from a Config (actor, reference, critic, tokenizer; no Ray),
           then 3 generation batches of 32 prompts (``make_experience``, max_new_tokens 8).
  trainer: actor + critic + ``PPOLearner`` with ``LocalStrategy`` (AdamW states), 2
           ``train_step``s on 64 fake items (16 prompt + 8 response tokens), 2 PPO epochs.
GPT-2-small shape: 12 layers x 768, vocab 50257, random weights saved with ``save_pretrained`` to
a temp dir; its tokenizer is a word-level one with the tiny tokenizer's ids (pad 0, eos 1, the
ten digits) padded with filler words to 50257 entries, so the toy task and reward work unchanged.
Peak RSS is not timing-noisy: one run per cell (``--repeats`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import _common
from _common import median, publish, rss_mb


def build_gpt2_small(directory: str, n_layer: int = 12, n_embd: int = 768, n_head: int = 12) -> str:
    """A GPT-2-small-shaped model (random weights) and a digit-compatible tokenizer saved to ``directory``;
    ``n_layer``/``n_embd``/``n_head`` shrink it (``benchmarks/estimators.py``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from ray_ppo.models.tiny import SPECIAL_TOKENS, WORDS

    words = list(SPECIAL_TOKENS + WORDS)
    words += [f"w{i}" for i in range(50257 - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  padding_side="left")
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def child(role: str, pretrained: str) -> dict:
    import torch

    from ray_ppo.config import load_config

    base = rss_mb()
    cfg = load_config(str(_common.ROOT / "configs" / "tiny.yaml")).with_overrides({
        "model.pretrained": pretrained, "data.path": str(_common.ROOT / "data" / "toy_prompts.csv")})
    from ray_ppo.api import resolve_config
    cfg = resolve_config(cfg)
    torch.manual_seed(0)
    texts = [" ".join("0123456789"[(i * 7 + j) % 10] for j in range(6)) for i in range(32)]
    if role == "maker":
        from ray_ppo.makers.worker import MakerWorker
        w = MakerWorker(0, cfg.to_dict(), None)
        built = rss_mb()
        for _ in range(3):
            w.maker.make_experience(w.encoder.encode(texts).ids, 0)
    else:
        from ray_ppo.algo import ExperienceBatch, ExperienceItem
        from ray_ppo.models.build import build_actor, build_critic
        from ray_ppo.train.learner import PPOLearner
        from ray_ppo.train.strategies import LocalStrategy
        torch.set_num_threads(1)
        learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg)
        built = rss_mb()
        R = 8
        items = [ExperienceItem(prompt_ids=torch.randint(3, 13, (16,)), response_ids=torch.randint(3, 13, (R,)),
                                action_log_probs=-torch.rand(R) * 3, ref_log_probs=-torch.rand(R) * 3,
                                values=torch.randn(R), rewards=torch.randn(R), advantages=torch.randn(R),
                                returns=torch.randn(R), reward=0.0, policy_version=0, uid=str(i)) for i in range(64)]
        for _ in range(2):  # AdamW states exist after the first step: the peak is reached by then
            learner.train_step(ExperienceBatch.merge(items, 0))
    params = sum(p.numel() for p in (w.maker.actor if role == "maker" else learner.actor).parameters())
    return {"imports_mb": base, "built_mb": built, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params_m": params / 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,gpt2-small")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("ROLE", "PRETRAINED"))
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            pretrained = "tiny" if name == "tiny" else build_gpt2_small(os.path.join(tmp, name))
            for role in ("maker", "trainer"):
                results = []
                for _ in range(args.repeats):
                    out = subprocess.run([sys.executable, __file__, "--child", role, pretrained], capture_output=True,
                                         text=True, env={**os.environ, "PYTHONPATH": str(_common.ROOT)})
                    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                    if not line:
                        print(out.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"{role} {name} failed")
                    results.append(json.loads(line[0][7:]))
                rows.append([name, role, median([r["params_m"] for r in results]), median([r["imports_mb"] for r in results]),
                             median([r["built_mb"] for r in results]), median([r["peak_mb"] for r in results]),
                             median([r["peak_mb"] - r["imports_mb"] for r in results])])
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print("Memory: peak RSS (ru_maxrss) of one maker / trainer process, CPU, float32\n")
    publish("memory", ["model", "process", "actor params (M)", "RSS after imports MiB", "RSS after build MiB",
                 "peak RSS MiB", "peak - imports MiB"], rows, args=args)


if __name__ == "__main__":
    main()

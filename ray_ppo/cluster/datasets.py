"""Prompt files read through Ray Data, for the coordinator's feed: the one module of the prompt
path that imports Ray (``ray_ppo.data`` checks and encodes prompts without it).

    ds = read_prompt_dataset("prompts.csv", "prompt")   # a lazy Ray Dataset of one column
"""

from __future__ import annotations

from pathlib import Path

from ray_ppo.data.prompts import DataError, _check_column, _check_local_path, infer_format

BLOCK_BYTES = 64 << 20
"""Bytes of a local prompt file per Ray Data block: prompts are read once, in order, by the
coordinator, and every further block is one more read task (on a small machine a task is a worker
process that imports Ray Data: seconds, for a file read in milliseconds)."""


def read_prompt_dataset(path: str, prompt_column: str, fmt: str | None = None, num_cpus: float = 0.25,
                        checked: bool = False):
    """A Ray Dataset with one column, ``prompt_column``, read from CSV, Parquet or JSON Lines.

    A CSV prompt column is read as text (Arrow would otherwise infer ``007`` as the number 7).
    Read tasks ask for ``num_cpus`` (a fraction) so they are scheduled beside long-lived actors;
    the column selection asks for the same, so Ray Data fuses it into the read task. A local input
    is read in blocks of ``BLOCK_BYTES`` (one block for any usual prompt file). ``checked``: the
    input was already checked here (``ray_ppo.config.preflight.check_run`` reads local files, with their
    column): a local one stays lazy, and the coordinator's first read executes it; otherwise its
    schema is read now, so a bad input fails here, named by its path.
    """
    import ray.data

    fmt = infer_format(path, fmt)
    _check_local_path(path)
    readers = {"csv": ray.data.read_csv, "parquet": ray.data.read_parquet, "json": ray.data.read_json}
    local = Path(path) if "://" not in path else None
    options = {"override_num_blocks": max(1, -(-_local_bytes(local) // BLOCK_BYTES))} if local else {}
    if fmt == "csv":
        options["convert_options"] = _csv_text_column(prompt_column)
    try:
        ds = readers[fmt](path, num_cpus=num_cpus, **options)
        columns = None if checked and local is not None else ds.schema().names  # reads the files now
    except Exception as e:  # Ray wraps reader errors in several types; the path is what the user needs
        raise DataError(f"cannot read data.path={path!r} as {fmt}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    if columns is not None:
        _check_column(columns, prompt_column, path)
    return ds.select_columns([prompt_column], num_cpus=num_cpus)


def _csv_text_column(column: str):
    """pyarrow CSV options that read ``column`` as strings (empty cells stay ``""``)."""
    import pyarrow
    import pyarrow.csv

    return pyarrow.csv.ConvertOptions(column_types={column: pyarrow.string()})


def _local_bytes(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)

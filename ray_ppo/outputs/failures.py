"""A run that fails after it started ends with one line; the full story goes to ``RUN_DIR/error.log``.

    line = report_failure(exc, run_dir)   # "maker_0 failed: RewardError: ... (full traceback: RUN_DIR/error.log)"

Ray wraps an error raised in a trainer worker or an actor several times (``WorkerGroupError`` ->
the worker's ``UserExceptionWithTraceback`` -> ``RayTaskError`` -> the error itself), and each
wrapper's text repeats the tracebacks below it. ``root_cause`` unwraps them to the error the
code raised, whose message is written to be read alone. An error that began in another process
than the one that raised it on its way to the driver (a maker's, which the trainer's pull raises)
carries that process's traceback (``origin_traceback``), and ``error.log`` holds it too.
"""

from __future__ import annotations

import datetime
import re
import traceback
from pathlib import Path

ERROR_LOG = "error.log"
"""File in the run directory that receives the full traceback of a failed run."""


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error of Ray's wrappers (Train worker failures, task errors, ``raise ... from``)."""
    *_, innermost = _chain(exc)
    return innermost


def _chain(exc: BaseException):
    """``exc`` and the errors it wraps, outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = _unwrap_once(exc)


def origin_tracebacks(exc: BaseException) -> list[str]:
    """The tracebacks that errors of the chain carry from where the error began in another process
    (``origin_traceback``: a maker's, ``ray_ppo.coordinator.state.MakerBook.failure``), which
    neither the driver's traceback nor Ray's remote ones hold."""
    found = (getattr(e, "origin_traceback", None) for e in _chain(exc))
    return list(dict.fromkeys(text for text in found if text))


def _unwrap_once(exc: BaseException) -> BaseException | None:
    failures = getattr(exc, "worker_failures", None)
    if failures:
        return failures[min(failures)]
    for attribute in ("_base_exc", "controller_failure"):
        inner = getattr(exc, attribute, None)
        if isinstance(inner, BaseException):
            return inner
    cause = getattr(exc, "cause", None)  # RayTaskError / RayActorError: the error raised remotely
    if isinstance(cause, BaseException):
        return cause
    return exc.__cause__


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of the root cause; for an actor whose ``__init__`` raised
    (Ray keeps only the text of that error), ``<actor> could not start: <its last traceback line>``."""
    cause = root_cause(exc)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    if getattr(cause, "_actor_init_failed", False):
        actor = re.search(r"ray::(?:([\w.-]+):)?(\w+)\.__init__", str(cause))
        raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
        if raised:
            name = (actor.group(1) or actor.group(2)) if actor else "an actor"
            return f"{name} could not start: {raised[-1]}"
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def write_error_log(exc: BaseException, run_dir: str | Path) -> Path:
    """Write the driver's traceback, every remote traceback Ray carried and the ``origin_tracebacks``
    (where the error began: a reward function's frames in a maker) to ``run_dir/error.log`` (appended)."""
    path = Path(run_dir) / ERROR_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} {one_line(exc)}\n")
        f.write("".join(traceback.format_exception(exc)))
        for origin in origin_tracebacks(exc):
            f.write(f"\nWhere the error began, in another process:\n\n{origin}")
        f.write("\n")
    return path


def report_failure(exc: BaseException, run_dir: str | Path | None) -> str:
    """The one line a failed run ends with; the full traceback goes to ``run_dir/error.log`` when there is one."""
    line = one_line(exc)
    if run_dir is None:
        return line
    try:
        return f"{line} (full traceback: {write_error_log(exc, run_dir)})"
    except OSError as e:  # the run directory itself is the problem: still one line
        return f"{line} (no traceback written: {e})"

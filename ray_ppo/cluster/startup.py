"""A start of a local Ray cluster that cannot hang: one start at a time on a machine, bounded, and
ended by Ctrl-C at every moment.

    with start_lock(), StartupWatch("ray-ppo train", on_give_up=claim.release):
        ray.init(address="local", ...)

``ray.init`` of a new local cluster blocks in Ray's native code (the core worker's constructor)
until the cluster's processes have registered. There Python runs no signal handler, so Ctrl-C
is not seen, and nothing bounds the wait. Two guards:

- ``start_lock``: a machine-wide file lock taken around the start, so clusters that several
  runs (or a run and a test suite) begin at the same moment start one after the other rather
  than competing for the same cores at their most fragile point.
- ``StartupWatch``: a thread that sees Ctrl-C (and SIGTERM) through Python's signal wake-up file
  descriptor, which the C-level handler writes even while the main thread is blocked, and the
  readiness bound (``ray_ppo.cluster.readiness.ready_timeout_s``). Either one ends the process in one
  line: the cluster processes it began are stopped, ``on_give_up`` undoes what the run had
  written (``RunDirClaim.release``), and the process exits with 130 (Ctrl-C), 143 (SIGTERM) or
  1 (the bound).

Inside them, ``start_once_more_if_node_timed_out`` gives a start a second try when Ray itself gave
up on it: Ray waits a fixed 30 s for its new node to register with the GCS (in its private node module,
not configurable), which a loaded 2-core machine can exceed.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from ray_ppo.cluster.readiness import READY_TIMEOUT_ENV, ready_timeout_s

LOCK_NAME = "ray_ppo-local-cluster-start.lock"
"""The machine-wide lock file, in the system's temporary directory."""
LOCK_NOTICE_S = 2.0
"""How long a wait for the lock lasts before the run says what it waits for."""
LOCK_POLL_S = 0.2
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}
EXIT_TIMED_OUT = 1


def lock_path() -> Path:
    return Path(tempfile.gettempdir()) / LOCK_NAME


@contextlib.contextmanager
def start_lock(label: str = "ray_ppo", timeout_s: float | None = None) -> Iterator[None]:
    """Hold the machine-wide start lock inside the block; wait for it (interruptibly) first.

    A holder that never lets go cannot keep this start out for ever: after ``timeout_s`` (the
    readiness bound) the start goes ahead without the lock. A lock file that cannot be opened
    (another user's, read-only) means no lock."""
    try:
        fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # every user of the machine takes the same lock
        _acquire(fd, label, ready_timeout_s() if timeout_s is None else timeout_s)
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, label: str, timeout_s: float) -> None:
    import fcntl

    start, noticed = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited > timeout_s:
            print(f"{label}: another local Ray cluster on this machine held {lock_path()} for {waited:.0f} s; "
                  f"starting without waiting for it", file=sys.stderr, flush=True)
            return
        if not noticed and waited > LOCK_NOTICE_S:
            print(f"{label}: waiting for another local Ray cluster on this machine to finish starting",
                  file=sys.stderr, flush=True)
            noticed = True
        time.sleep(LOCK_POLL_S)


class StartupWatch:
    """While the block runs on the main thread, Ctrl-C, SIGTERM or the bound end the process.

    Responsibilities: route the signals to a watcher thread (``signal.set_wakeup_fd``), wait for
    them or the deadline, and on either print one line, stop the child processes this process
    started (the cluster's), call ``on_give_up`` and exit. Leaving the block normally restores
    the signal set-up as it was. Off the main thread (where wake-up descriptors cannot be set)
    it does nothing."""

    def __init__(self, label: str, timeout_s: float | None = None, on_give_up: Callable[[], None] | None = None,
                 exit: Callable[[int], None] = os._exit):
        self.label, self.on_give_up, self._exit = label, on_give_up, exit
        self.timeout_s = ready_timeout_s() if timeout_s is None else timeout_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StartupWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        # SIGTERM ends a process without a Python handler, so only a handler makes it reach the wake-up
        # descriptor; should the main thread run Python again first, it is an interrupt there too.
        self._old_term = signal.signal(signal.SIGTERM, _interrupt)
        self._thread = threading.Thread(target=self._watch, name="ray_ppo-startup-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._done.set()
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")  # wakes the watcher (no signal has number 0)
        self._thread.join()
        signal.set_wakeup_fd(self._old_wakeup)
        if signal.getsignal(signal.SIGTERM) is _interrupt:
            signal.signal(signal.SIGTERM, self._old_term)
        os.close(self._read)
        os.close(self._write)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._give_up(EXIT_TIMED_OUT, self._timed_out_line())
                return
            ready, _, _ = select.select([self._read], [], [], remaining)
            if not ready:
                continue
            received = os.read(self._read, 512)
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signum in received and not self._done.is_set():
                    self._give_up(EXIT_INTERRUPTED[signum],
                                  f"{self.label}: {signal.Signals(signum).name} while the local Ray cluster was "
                                  f"starting; stopped it, nothing was trained")
                    return

    def _timed_out_line(self) -> str:
        logs = _session_logs()
        where = f"; read {logs}/raylet.out and {logs}/gcs_server.out" if logs else ""
        return (f"{self.label}: Ray did not start within {self.timeout_s:.0f} s (a busy machine, or another Ray "
                f"cluster starting at the same time){where}; stopped it, nothing was trained; run the command "
                f"again, or set {READY_TIMEOUT_ENV} to wait longer")

    def _give_up(self, code: int, line: str) -> None:
        try:
            _stop_children()
            if self.on_give_up is not None:
                self.on_give_up()
        finally:
            print(line, file=sys.stderr, flush=True)
            self._exit(code)


NODE_TIMED_OUT = "timed out during startup"
"""Part of the error ``ray.init`` raises when its new node did not register within Ray's fixed 30 s."""


def start_once_more_if_node_timed_out(start: Callable[[], None], label: str = "ray_ppo") -> None:
    """Call ``start`` (a ``ray.init`` of a new local cluster); if Ray gives up on its node's registration,
    stop the processes that attempt started, say so in one line and call ``start`` once more. A second
    such failure raises a RuntimeError that names the cause and the fix; any other error passes through."""
    import ray

    before = {child.pid for child in _children()}
    for attempt in (1, 2):
        try:
            start()
            return
        except Exception as error:  # Ray raises a bare Exception here
            if NODE_TIMED_OUT not in str(error):
                raise
            failed = error
        with contextlib.suppress(Exception):
            ray.shutdown()
        _stop([child for child in _children() if child.pid not in before])
        if attempt == 1:
            print(f"{label}: Ray's node did not register within Ray's fixed 30 s (a busy machine); stopped it, "
                  f"starting the local Ray cluster once more", file=sys.stderr, flush=True)
    raise RuntimeError(f"{label}: the local Ray cluster did not start, twice: Ray's node did not register within "
                       f"Ray's fixed 30 s (the machine is too busy); nothing ran; run the command again when "
                       f"fewer programs compete for its cores") from failed


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _children():
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _session_logs() -> str | None:
    """The logs folder of the Ray session this process began, read off its child processes' command lines."""
    for child in _children():
        try:
            command = " ".join(child.cmdline())
        except Exception:
            continue
        found = re.search(r"(\S*/session_[^/\s]+)", command)
        if found:
            return f"{found.group(1)}/logs"
    return None


def _stop_children(grace_s: float = 3.0) -> None:
    """End the processes this process started (a half-started cluster): SIGTERM, then SIGKILL."""
    _stop(_children(), grace_s)


def _stop(children: list, grace_s: float = 3.0) -> None:
    """SIGTERM each of ``children`` (psutil processes), then SIGKILL those still alive after ``grace_s``."""
    import psutil

    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()

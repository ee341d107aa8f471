"""One ``ray-ppo`` command as a user runs it, and the processes of its local Ray cluster, found
by the cluster's temp dir (shared by the e2e modules).

A process belongs to the cluster if its command line names the temp dir or it holds a file open
under it: Ray's agents retitle themselves (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), so
their command lines no longer name it, but their logs stay open there. ``ray stop`` would stop
every Ray cluster on the machine, a developer's own included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).parents[2]
RUN_TIMEOUT_S = 480  # a loaded 2-core machine takes minutes to start a cluster and build the models
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's node agents outlive a SIGKILLed driver's local cluster by about a minute (measured: 60 s,
then they exit on their own); its GCS, raylet and workers go within seconds. A clean exit stops them."""


class Cli:
    """One ``ray-ppo COMMAND ARGS`` process with a Ray temp dir of its own; Ctrl-C reaches it as it
    reaches a command typed in a terminal (a background process starts with SIGINT ignored).
    Its stdout and stderr go to files under ``tmp_path`` (a pipe left unread could fill and
    stall it)."""

    def __init__(self, command: str, args: list[str], tmp_path: Path):
        self.ray_tmp = tempfile.mkdtemp(prefix="rp_", dir="/tmp")  # short: Ray's socket paths have a length limit
        env = {**os.environ, "RAY_TMPDIR": self.ray_tmp,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        name = f"cli-{command}-{time.monotonic_ns()}"
        self.out, self.err = open(tmp_path / f"{name}.out", "w+"), open(tmp_path / f"{name}.err", "w+")
        self.leaked: list[str] | None = None
        self.killed = False
        self.proc = subprocess.Popen([sys.executable, "-m", "ray_ppo.cli", command, *args], cwd=REPO, env=env,
                                     stdout=self.out, stderr=self.err,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str]:
        """The exit status and stderr; the CLI and its cluster are gone after it (``close``)."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            self.close()
        return self.proc.returncode, self.stderr()

    def wait_until(self, predicate, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Poll ``predicate`` until it holds; fail if the CLI ends or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"the run ended early ({self.proc.returncode}): {self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"the run did not get there in time: {self.stderr()[-3000:]}"
            time.sleep(0.2)

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def interrupt(self) -> None:
        """Ctrl-C."""
        self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """kill -9 of the driver: no clean-up of any kind."""
        self.killed = True
        self.proc.kill()

    def leftover_ray_processes(self, grace_s: float = 15) -> list[str]:
        """Processes of this CLI's Ray cluster still alive ``grace_s`` after it exited, as
        'name pid' (after a kill -9, all but Ray's agents: ``RAY_AGENTS``). Every process of the
        cluster still alive then is killed (they are this test's own)."""

        def should_be_gone(p) -> bool:
            return not (self.killed and p.info["name"] in RAY_AGENTS)

        deadline = time.monotonic() + grace_s
        while (left := [p for p in cluster_processes(self.ray_tmp) if should_be_gone(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        kill_all(cluster_processes(self.ray_tmp))
        return [f"{p.info['name']} {p.pid}" for p in left]

    def close(self) -> None:
        """Make sure the CLI and its cluster are gone; ``leaked``: what outlived the CLI."""
        if self.proc.poll() is None:
            self.kill()
            self.proc.wait()
        if self.leaked is None:
            self.leaked = self.leftover_ray_processes()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """Live processes of the cluster under ``temp_dir`` (never this test process); each one's
    ``info`` holds its pid, name and command line as they were when it was found."""

    def of_this_cluster(p: psutil.Process) -> bool:
        try:
            return (any(temp_dir in arg for arg in (p.info["cmdline"] or []))
                    or any(f.path.startswith(temp_dir) for f in p.open_files()))
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            return False

    return [p for p in psutil.process_iter(["pid", "name", "cmdline"]) if p.pid != os.getpid() and of_this_cluster(p)]


def kill_all(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    """SIGKILL each of ``processes`` and wait until they are gone."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)

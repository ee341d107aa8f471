"""The processes of one local Ray cluster, found by its temp dir (shared by the e2e modules).

A process belongs to the cluster if its command line names the temp dir or it holds a file open
under it: Ray's agents retitle themselves (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``), so
their command lines no longer name it, but their logs stay open there. ``ray stop`` would stop
every Ray cluster on the machine, a developer's own included.
"""

from __future__ import annotations

import os

import psutil


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

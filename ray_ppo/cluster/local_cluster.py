"""The local Ray cluster that ``ray-ppo``, ``PPOTrainer.fit()`` and ``sweep()`` start when none is connected.

    start_local_cluster(num_cpus=None, sweep=False, label="ray-ppo train", on_give_up=claim.release)

Always a new cluster (``address="local"``), never one that already runs on the machine (a plain
``ray.init()`` would attach to it); attach to one on purpose with ``ray.init(address=...)`` or
``ray-ppo ... --address``. Worker logs stay in the Ray session directory; errors reach the
driver as exceptions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Callable

MIN_LOCAL_CPUS = 8
"""Logical CPUs of a local cluster at least: more than a small machine's cores, so fractional
makers, a trainer worker and the prompt reader all fit (tiny models need no more)."""


WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's niceness for worker processes (15 unless set), read by the raylet when it starts."""


def local_cpus(num_cpus: int | None = None) -> int:
    """Logical CPUs of the local cluster: ``num_cpus`` if given, else max(8, cores)."""
    return num_cpus or max(MIN_LOCAL_CPUS, os.cpu_count() or 1)


def start_local_cluster(num_cpus: int | None = None, sweep: bool = False, label: str = "ray_ppo",
                        on_give_up: Callable[[], None] | None = None, **init_kwargs) -> None:
    """Start a local cluster with ``local_cpus(num_cpus)`` logical CPUs (``init_kwargs`` go to
    ``ray.init``). ``sweep``: the cluster serves Ray's state API (the dashboard, on loopback),
    which a sweep needs (``ray_ppo.cluster.sweep.wait_for_cleaner``), and this returns once it answers.

    One start at a time on the machine, bounded and interruptible (``ray_ppo.cluster.startup``): on
    Ctrl-C or past the readiness bound the process prints one line starting with ``label``,
    calls ``on_give_up`` and exits."""
    # The driver's one Ray Data execution (reading the prompt file's schema) would log its plan and
    # progress every 10 s; warnings and errors still show.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Ray Train's controller polls workers every 2 s by default and each ray.train.report
    # waits for that poll; a faster poll keeps reports cheap on a local cluster.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Ray Train starts a PreemptionWatcher actor per worker group to poll for draining nodes: a
    # local cluster has none to drain, so the watcher's process is start-up cost for nothing. A
    # cluster attached to keeps it.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # The raylet starts its worker processes at nice 15 (Ray's worker_niceness), under everything
    # else on the machine, so any other busy program starves them. A cluster ray_ppo starts for one
    # run shares the machine as any program the user starts does, at nice 0 (what Ray's job manager
    # gives a job's driver); a value the user set is kept.
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    cpus = local_cpus(num_cpus)
    # The raylet starts at most min(cores, num_cpus) worker processes at a time and, once 4x that
    # many have started, prints "N PYTHON worker processes have been started ... 4x the maximum
    # expected startup concurrency" to the driver's stdout: one fit() starts a coordinator, makers,
    # Ray Train's controller and workers and a read task, more than 4x the cores of a small machine,
    # and a sweep that many per trial. Allowing num_cpus at a time (twice that for a sweep) removes
    # the warning (benchmarks/startup.py measures start-up with it).
    os.environ.setdefault("RAY_worker_maximum_startup_concurrency", str(int(cpus) * (2 if sweep else 1)))
    # No dashboard for one run: the run's placement groups end with the job. A sweep needs it:
    # Tune ends an early-stopped trial's process, its Ray Train controller dies with it, and only
    # the dashboard's state API lets Ray Train see that and free the worker group's CPUs.
    if not sweep:
        _one_start(label, on_give_up, num_cpus=cpus, include_dashboard=False, **init_kwargs)
        return
    port = free_port()
    _dashboard_startup_bound()
    # Ray Train's placement-group cleaner calls the state API from a worker without an address: left
    # to look for Ray, it raised "Found multiple active Ray instances" whenever another cluster ran on
    # the machine, and the CPUs of a trial Tune stopped stayed reserved. Named in the environment the
    # cluster's processes inherit, it reaches this cluster (a value the caller set is kept).
    with scoped_env(API_SERVER_ENV, f"http://127.0.0.1:{port}", users_wins=True):
        _one_start(label, on_give_up, num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                   dashboard_port=port, **init_kwargs)
    from ray_ppo.cluster.readiness import wait_for_state_api

    wait_for_state_api()


def _one_start(label: str, on_give_up: Callable[[], None] | None, **init_kwargs) -> None:
    """``ray.init(address="local", log_to_driver=False, **init_kwargs)`` as the machine's one start
    (``start_lock``), bounded and interruptible (``StartupWatch``), made once more if Ray gave up on
    its node, with the node's agents given their ports before they start (``agent_ports_chosen``
    says why: its raylet then does not wait for them, which on a busy machine ended the start)."""
    import ray

    from ray_ppo.cluster.ray_private import agent_ports_chosen
    from ray_ppo.cluster.startup import StartupWatch, start_lock, start_once_more_if_node_timed_out

    with start_lock(label), StartupWatch(label, on_give_up=on_give_up), agent_ports_chosen(free_port):
        start_once_more_if_node_timed_out(
            lambda: ray.init(address="local", log_to_driver=False, **init_kwargs), label)


DASHBOARD_STARTUP_ENV = "RAY_DASHBOARD_STARTUP_TIMEOUT_S"


def _dashboard_startup_bound() -> None:
    """``ray.init`` gives the dashboard ``RAY_DASHBOARD_STARTUP_TIMEOUT_S`` (60 s by default) to come
    up and then fails the whole start ("Failed to start the dashboard"); beside two busy loops on 2
    cores it took longer. Unless the user set that variable, the bound becomes the readiness bound
    of every other wait on Ray's services (``ray_ppo.cluster.readiness.ready_timeout_s``). Ray reads the
    variable once, when it is imported, so its module constant is raised too."""
    from ray_ppo.cluster.readiness import ready_timeout_s

    if DASHBOARD_STARTUP_ENV in os.environ:
        return
    bound = int(ready_timeout_s())
    os.environ[DASHBOARD_STARTUP_ENV] = str(bound)  # for the processes this one starts
    from ray_ppo.cluster.ray_private import raise_constant

    raise_constant(DASHBOARD_STARTUP_ENV, bound)


API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"
"""Where Ray's state API clients send their calls; without it they look for Ray on the machine."""


@contextlib.contextmanager
def scoped_env(key: str, value: str, users_wins: bool = False):
    """Inside: ``os.environ[key] = value`` (kept as it was if ``users_wins`` and it is set); after: as before."""
    previous = os.environ.get(key)
    if not (users_wins and previous is not None):
        os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def free_port() -> int:
    """A TCP port free on every interface now (the dashboard or an agent binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]

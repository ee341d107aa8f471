"""Bounded waits for Ray's services: each polls until the service answers, or fails in one line.

    wait_for_state_api()                           # ray.util.state answers (the dashboard serves it)
    client = job_client("http://127.0.0.1:8265")   # the dashboard's job API answers
    job_id = submit_job(client, entrypoint=...)    # the head's job agent takes the job

A cluster's dashboard, state API and job agent come up seconds after ``ray.init`` or
``ray start`` returns, and minutes after on a machine busy with other work. Each wait here is bounded by
``ready_timeout_s()``, which ``RAY_PPO_SERVICE_READY_TIMEOUT_S`` sets.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

READY_TIMEOUT_ENV = "RAY_PPO_SERVICE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 600.0
"""How long a wait for a Ray service lasts by default: sized for a loaded 2-core machine."""
POLL_S = 1.0


class ServiceNotReady(RuntimeError):
    """A Ray service did not answer within the bound; the message names it, the bound and the fix."""


def ready_timeout_s() -> float:
    """The bound on each wait: ``$RAY_PPO_SERVICE_READY_TIMEOUT_S``, else ``DEFAULT_READY_TIMEOUT_S``."""
    value = os.environ.get(READY_TIMEOUT_ENV)
    if value is None:
        return DEFAULT_READY_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{READY_TIMEOUT_ENV}={value!r} must be a number of seconds > 0 (e.g. 600)")
    return seconds


def wait_until(probe: Callable[[], Any], what: str, timeout_s: float | None = None, poll_s: float = POLL_S,
               not_ready: tuple[type[BaseException], ...] = (Exception,)) -> Any:
    """Call ``probe`` until it returns; return what it returned.

    An error of a ``not_ready`` type means "not up yet" (others are raised at once). Raises
    ``ServiceNotReady`` naming ``what``, the bound and the probe's last error once ``timeout_s``
    (default ``ready_timeout_s()``) has passed."""
    timeout_s = ready_timeout_s() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return probe()
        except not_ready as e:
            last = e
        if time.monotonic() >= deadline:
            lines = str(last).strip().splitlines()
            raise ServiceNotReady(
                f"{what} did not answer within {timeout_s:.0f} s (last error: {type(last).__name__}: "
                f"{lines[0] if lines else ''}); on a busy machine it can take minutes: set {READY_TIMEOUT_ENV} "
                f"to wait longer, or see the cluster's logs") from last
        time.sleep(poll_s)


def dashboard_url() -> str | None:
    """The connected cluster's dashboard address, or None if it runs without one.

    Ray has no public call for it on an attached driver: it is read from the driver's node
    (``ray_ppo.cluster.ray_private.driver_node``)."""
    from ray_ppo.cluster.ray_private import driver_node

    node = driver_node()
    return node.webui_url if node is not None else None


def state_api_answers() -> None:
    """One call through Ray's state API of the connected cluster; raises if it does not answer.

    The call names the cluster's dashboard: left to find it, the state API looks for Ray on this
    machine and refuses to choose when it finds several clusters ("Found multiple active Ray
    instances"), as on a machine that runs other Ray jobs, or tests that start clusters of their own."""
    from ray.util.state import list_actors

    url = dashboard_url()
    if not url:
        raise ConnectionError("the connected Ray cluster runs without the dashboard, which serves the state API")
    list_actors(address=url if "://" in url else f"http://{url}", limit=1, timeout=10, raise_on_missing_output=False)


def wait_for_state_api(timeout_s: float | None = None) -> None:
    """Wait until Ray's state API (served by the dashboard) answers on the connected cluster."""
    wait_until(state_api_answers, "Ray's state API (the dashboard)", timeout_s)


def job_client(address: str, timeout_s: float | None = None):
    """A ``JobSubmissionClient`` for ``address``, once the dashboard's HTTP server answers there."""
    from ray.job_submission import JobSubmissionClient

    return wait_until(lambda: JobSubmissionClient(address), f"Ray's dashboard at {address}", timeout_s,
                      not_ready=(ConnectionError,))


NO_AGENT = "No available agent"
"""What the dashboard answers (status 500) to a job submitted before the head's job agent is up."""


class AgentNotUp(RuntimeError):
    """The dashboard refused a job for want of a job agent on the head node."""


def submit_job(client: Any, timeout_s: float | None = None, **submit_kwargs) -> str:
    """``client.submit_job(**submit_kwargs)``, again while the head's job agent is not up yet.

    A submission the dashboard refuses for want of an agent creates no job, so it is safe to
    repeat; any other error is raised at once."""
    def submit() -> str:
        try:
            return client.submit_job(**submit_kwargs)
        except RuntimeError as e:
            if NO_AGENT in str(e):
                raise AgentNotUp(str(e)) from e
            raise

    return wait_until(submit, "the job agent of Ray's head node", timeout_s, poll_s=2.0, not_ready=(AgentNotUp,))

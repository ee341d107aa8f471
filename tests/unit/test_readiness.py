"""Bounded waits for Ray's services (``ray_ppo.cluster.readiness``), with stand-in services: no cluster."""

from __future__ import annotations

import pytest

from ray_ppo.cluster import readiness
from ray_ppo.cluster.readiness import ServiceNotReady, ready_timeout_s, submit_job, wait_until


class SlowService:
    """Answers after ``failures`` calls that raise ``error``."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "up"


def test_a_wait_returns_once_the_service_answers():
    service = SlowService(3, ConnectionError("refused"))
    assert wait_until(service, "the service", timeout_s=30, poll_s=0) == "up"
    assert service.calls == 4


def test_a_wait_past_its_bound_names_the_service_the_bound_the_last_error_and_the_fix():
    with pytest.raises(ServiceNotReady) as e:
        wait_until(SlowService(10**9, ConnectionError("refused\nmore")), "Ray's state API", timeout_s=0.05, poll_s=0.01)
    message = str(e.value)
    assert message.startswith("Ray's state API did not answer within 0 s (last error: ConnectionError: refused)")
    assert "RAY_PPO_SERVICE_READY_TIMEOUT_S" in message and "\n" not in message


def test_an_error_that_is_not_a_sign_of_starting_up_is_raised_at_once():
    service = SlowService(1, ValueError("bad address"))
    with pytest.raises(ValueError, match="bad address"):
        wait_until(service, "the service", timeout_s=30, poll_s=0, not_ready=(ConnectionError,))
    assert service.calls == 1


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(readiness.READY_TIMEOUT_ENV, raising=False)
    assert ready_timeout_s() == readiness.DEFAULT_READY_TIMEOUT_S
    monkeypatch.setenv(readiness.READY_TIMEOUT_ENV, "42")
    assert ready_timeout_s() == 42.0
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(readiness.READY_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"RAY_PPO_SERVICE_READY_TIMEOUT_S='{bad}' must be a number of seconds"):
            ready_timeout_s()


class JobClient:
    """A ``JobSubmissionClient`` whose head has no job agent for the first ``refusals`` submissions."""

    def __init__(self, refusals: int, other_error: Exception | None = None):
        self.refusals, self.other_error, self.submitted = refusals, other_error, []

    def submit_job(self, **kwargs):
        if self.other_error is not None:
            raise self.other_error
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, "
                               "please try again later..")
        self.submitted.append(kwargs)
        return "raysubmit_1"


def test_a_job_is_submitted_once_the_agent_is_up(monkeypatch):
    monkeypatch.setattr(readiness.time, "sleep", lambda s: None)
    client = JobClient(refusals=5)
    assert submit_job(client, timeout_s=60, entrypoint="python -c pass") == "raysubmit_1"
    assert client.submitted == [{"entrypoint": "python -c pass"}]


def test_a_job_agent_that_never_comes_up_fails_in_one_line():
    with pytest.raises(ServiceNotReady, match=r"^the job agent of Ray's head node did not answer within 0 s "
                                              r"\(last error: AgentNotUp: Request failed with status code 500: No available"):
        submit_job(JobClient(refusals=10**9), timeout_s=0.01, entrypoint="x")


def test_any_other_submission_error_is_raised_at_once():
    with pytest.raises(RuntimeError, match="status code 400: bad runtime_env"):
        submit_job(JobClient(0, RuntimeError("Request failed with status code 400: bad runtime_env")), timeout_s=60,
                   entrypoint="x")


def test_no_dashboard_is_known_without_a_cluster():
    """``dashboard_url`` reads the driver's node (``ray_ppo.cluster.ray_private``; tests/unit/test_ray_private.py
    fails on a Ray release that moves it)."""
    assert readiness.dashboard_url() is None

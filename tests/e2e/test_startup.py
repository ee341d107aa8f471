"""A start that cannot hang: `ray-ppo train` whose `ray.init` blocks in native code (as Ray's core
worker constructor did when another cluster started beside it) ends on Ctrl-C and past the
readiness bound, in one line, leaving no run directory; runs started at the same moment on one
machine all start and finish (`ray_ppo.cluster.startup`); and a start survives agents slower
than the raylet's fixed wait for them (`ray_ppo.cluster.ray_private.agent_ports_chosen`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
TINY = ["--config", "configs/tiny.yaml", "trainer.total_steps=2", "trainer.train_batch_size=8",
        "trainer.mini_batch_size=8", "trainer.ppo_epochs=1", "maker.batch_size=4", "maker.num_makers=1",
        "logging.progress=false"]

# ray.init replaced by a call that blocks in C and never returns to Python: a second lock of a
# normal pthread mutex by its holder. No Python signal handler runs while it waits.
BLOCKED_START = r"""
import ctypes, sys
import ray

def blocked_init(*args, **kwargs):
    libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    print("ray.init is blocked", file=sys.stderr, flush=True)
    libc.pthread_mutex_lock(mutex)

ray.init = blocked_init
from ray_ppo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def blocked_train(out: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BLOCKED_START, "train", *TINY, "--output", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def stderr_within(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The rest of ``proc``'s stderr once it exits within ``timeout_s``; else it is killed and the test fails."""
    try:
        return proc.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        printed = proc.communicate()[1]
        pytest.fail(f"{what} within {timeout_s:g} s; its stderr since: {printed[-2000:]!r}")


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float = 180) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    pytest.fail(f"never saw {text!r}: {''.join(lines)[-2000:]}")


def test_ctrl_c_ends_a_start_blocked_in_native_code(tmp_path):
    out = tmp_path / "run"
    proc = blocked_train(out)
    wait_for_line(proc, "ray.init is blocked")
    assert out.is_dir()  # the run directory was claimed before the cluster started
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest = stderr_within(proc, 30, "Ctrl-C did not end a blocked start")
    assert proc.returncode == 130, rest
    assert rest.strip().splitlines() == [
        "ray-ppo train: SIGINT while the local Ray cluster was starting; stopped it, nothing was trained"]
    assert not out.exists()  # no run directory left behind: the same command runs again without --overwrite


def test_a_start_past_the_readiness_bound_ends_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = blocked_train(out, {"RAY_PPO_SERVICE_READY_TIMEOUT_S": "3"})
    rest = stderr_within(proc, 180, "a blocked start with a 3 s bound did not end")
    assert proc.returncode == 1, rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("ray-ppo train: Ray did not start within 3 s") and "RAY_PPO_SERVICE_READY_TIMEOUT_S" in last
    assert not out.exists()


def test_runs_started_at_the_same_moment_all_finish(tmp_path):
    """A `ray-ppo train` and a `ray-ppo tune` started at once (the two kinds of local cluster), each
    with a cluster of its own. Four clusters starting at once: test_four_local_clusters_started_at_once."""
    commands = [[sys.executable, "-m", "ray_ppo.cli", "train", *TINY, "--output", str(tmp_path / "run")],
                [sys.executable, "-m", "ray_ppo.cli", "tune", *TINY, "--grid", "ppo.kl_coef=0.01",
                 "--output", str(tmp_path / "sweep")]]
    procs = [subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a run started beside another did not finish within 15 min")
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
    assert "done: 2 steps" in outputs[0] and "best:" in outputs[1]


CLUSTER_START = r"""
import sys, time
start = time.monotonic()
from ray_ppo.cluster.local_cluster import start_local_cluster
import ray
start_local_cluster(label="start " + sys.argv[1])
assert ray.get(ray.remote(lambda: 1).remote()) == 1
ray.shutdown()
print(f"started and ran a task in {time.monotonic() - start:.0f} s")
"""


def test_four_local_clusters_started_at_once():
    procs = [subprocess.Popen([sys.executable, "-c", CLUSTER_START, str(i)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0 and "started and ran a task" in output, output[-3000:]


# Ray's two agent processes (the dashboard agent and the runtime-env agent) sleep before they start,
# as an agent did beside three busy runs on 2 cores: longer than the raylet's fixed 15 s wait for
# the ports they bind.
SLOW_AGENTS = """
import time
cmdline = open("/proc/self/cmdline", "rb").read()
if b"dashboard/agent.py" in cmdline or b"runtime_env/agent/main.py" in cmdline:
    time.sleep({delay_s})
"""
AGENT_DELAY_S = 20


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_local_cluster_starts_though_its_agents_are_slower_than_the_raylets_wait(tmp_path, sweep):
    (tmp_path / "sitecustomize.py").write_text(SLOW_AGENTS.format(delay_s=AGENT_DELAY_S))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    start = CLUSTER_START.replace("start_local_cluster(", "start_local_cluster(sweep=%s, " % sweep)
    proc = subprocess.run([sys.executable, "-c", start, "slow agents"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "started and ran a task" in output, output[-3000:]
    assert "did not register" not in output  # started at the first attempt

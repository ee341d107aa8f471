"""Stopping and resuming `ray-ppo train` as a user does: Ctrl-C, `kill -9` of the driver, a run
that fails before its first step, a reused run directory, a finished run.

Each CLI run is a subprocess with its own local Ray cluster under a temporary directory of its
own (RAY_TMPDIR), so the test can check that no process of that cluster outlives the driver,
and kill (by pid) any that does before failing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_processes import cluster_processes, kill_all

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
SMALL = ["trainer.train_batch_size=8", "trainer.mini_batch_size=8", "trainer.ppo_epochs=1", "maker.batch_size=4",
         "trainer.checkpoint_every=2", "trainer.pull_timeout_s=300", "logging.progress=false"]
RUN_TIMEOUT_S = 480  # a loaded 2-core machine takes minutes to start a cluster and build the models
STOP_LIMIT_S = 45
"""Ctrl-C to exit, including Ray's shutdown (seconds; ~10 s on an idle machine, more under load)."""
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's node agents outlive a SIGKILLed driver's local cluster by about a minute (measured: 60 s,
then they exit on their own); its GCS, raylet and workers go within seconds. A clean exit stops them."""


def prompts_csv(tmp_path: Path, n: int) -> Path:
    """The first ``n`` toy prompts as a CSV of their own (prompt ids are rows 0..n-1 of it)."""
    lines = (REPO / "data" / "toy_prompts.csv").read_text().splitlines()
    path = tmp_path / f"prompts{n}.csv"
    path.write_text("\n".join(lines[:n + 1]) + "\n")
    return path


class Cli:
    """One `ray-ppo train` process with a Ray temp dir of its own."""

    def __init__(self, args: list[str], tmp_path: Path):
        self.ray_tmp = tempfile.mkdtemp(prefix="rp_", dir="/tmp")  # short: Ray's socket paths have a length limit
        env = {**os.environ, "RAY_TMPDIR": self.ray_tmp,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.out = open(tmp_path / f"cli-{time.monotonic_ns()}.log", "w+")
        self.leaked: list[str] | None = None
        self.killed = False
        self.proc = subprocess.Popen([sys.executable, "-m", "ray_ppo.cli", "train", *args], cwd=REPO, env=env,
                                     stdout=self.out, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        finally:
            self.close()
        return self.proc.returncode, err

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

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


def steps_in(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def versions_in(run: Path) -> list[int]:
    return [json.loads(line)["policy_version"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_state(run: Path) -> dict | None:
    try:
        return json.loads((run / "checkpoint" / "state.json").read_text())
    except (OSError, ValueError):
        return None


def wait_until(cli: Cli, predicate, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert cli.proc.poll() is None, f"the run ended early ({cli.proc.returncode}): {cli.proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.2)


def past_checkpoint(run: Path, after: int = 0):
    """True once RUN_DIR/checkpoint holds a step > ``after`` and a later step was trained."""
    def check() -> bool:
        state = checkpoint_state(run)
        return state is not None and state["step"] > after and max(steps_in(run), default=0) > state["step"]
    return check


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_ctrl_c_then_kill_9_and_two_resumes_train_every_prompt_exactly_once(tmp_path):
    """Ctrl-C stops the run cleanly; its resume is killed with kill -9 (no clean-up of any kind);
    a second resume runs to the end. 3 makers generate, so prompts are in flight at each stop. By
    prompt identity, every prompt of the first epoch is trained exactly once, and no prompt twice;
    steps and policy versions go on from each checkpoint. Then the finished run has nothing to do,
    and a new run refuses its directory. (One run through both stops: each CLI run starts a
    cluster of its own, ~40 s of the suite.)"""
    # Steps take well under a second here, RUN_DIR/checkpoint follows the run by a poll or two,
    # and Ctrl-C stops it a few steps later (seen: interrupted after step 8, checkpoint of step 6);
    # the kill then needs a later checkpoint and a step after it: 20 steps hold both. 20 x 8 items
    # are the first epoch of 96 prompts and two thirds of the second, all in the checkpoint's log
    # of trained prompts (it keeps the current and the previous epoch).
    n_prompts, total = 96, 20
    run = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", "--output", str(run), f"data.path={prompts_csv(tmp_path, n_prompts)}",
            "maker.num_makers=3", f"trainer.total_steps={total}", *SMALL]
    cli = Cli(args, tmp_path)
    wait_until(cli, past_checkpoint(run))
    sent = time.monotonic()
    cli.proc.send_signal(signal.SIGINT)
    code, err = cli.wait()
    stop_s = time.monotonic() - sent
    interrupted = [checkpoint_state(run)]
    saved, last = interrupted[0]["step"], max(steps_in(run))
    assert code == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"ray-ppo train: interrupted after step {last}; {run}/checkpoint holds "
                                            f"step {saved}: resume with: ray-ppo train --resume {run}")
    assert stop_s < STOP_LIMIT_S and cli.leaked == []
    print(f"Ctrl-C at step {last}: exit 130 after {stop_s:.1f} s; checkpoint at step {saved}")

    cli = Cli(["--resume", str(run)], tmp_path)
    wait_until(cli, past_checkpoint(run, after=saved))
    cli.kill()
    cli.wait()
    assert cli.leaked == []  # the local cluster died with its driver (Ray's agents a minute later)
    interrupted.append(checkpoint_state(run))

    cli = Cli(["--resume", str(run)], tmp_path)
    code, err = cli.wait()
    assert code == 0 and cli.leaked == [], err[-3000:]
    in_flight = [s["data"]["next"] - s["data"]["watermark"] - len(s["data"]["done"]) for s in interrupted]
    assert sum(in_flight) > 0  # prompts handed out but not trained when the checkpoints were taken
    final = checkpoint_state(run)
    assert final["step"] == total
    assert steps_in(run) == list(range(1, total + 1))  # rows after each checkpoint were redone, not doubled
    assert versions_in(run) == list(range(1, total + 1))  # the policy version went on from each checkpoint's
    trained = [pid for _, ids in final["data"]["trained"] for pid in ids]
    assert len(trained) == total * 8 == len(set(trained)), "a prompt was trained twice"
    assert set(range(n_prompts)) <= set(trained), f"never trained: {sorted(set(range(n_prompts)) - set(trained))}"
    steps_of = {step for step, _ in final["data"]["trained"]}
    assert steps_of == set(range(1, total + 1))  # the log spans all three processes' steps
    print(f"stopped at checkpoints {[s['step'] for s in interrupted]} with {in_flight} prompts in flight; "
          f"{len(trained)} prompts trained, each once")

    started = time.monotonic()
    cli = Cli(["--resume", str(run), f"trainer.total_steps={total}"], tmp_path)
    code, err = cli.wait()
    assert code == 0 and time.monotonic() - started < 60  # no Ray cluster was started
    assert cli.stdout().strip() == (f"run {run} has already trained {total} steps (trainer.total_steps={total}): "
                                    f"nothing to do; to train further: ray-ppo train --resume {run} "
                                    f"trainer.total_steps={2 * total}")

    before = (run / "metrics.jsonl").read_text()
    started = time.monotonic()
    code, err = Cli(["--config", "configs/tiny.yaml", "--output", str(run)], tmp_path).wait()
    assert code == 2 and time.monotonic() - started < 60
    assert err.strip() == (f"ray-ppo train: error: run directory {run} already holds a run (checkpoint, checkpoints, "
                           f"config.yaml, curves.png, ...); continue it with --resume {run}, replace it with "
                           f"--overwrite, or give another --output")
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_run_that_fails_before_its_first_step_leaves_the_directory_as_it_was(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: the old run\n")
    started = time.monotonic()
    # os:getcwd takes no arguments: the makers' first reward call raises, before any step
    cli = Cli(["--config", "configs/tiny.yaml", "--output", str(run), "--overwrite", "model.reward_fn=os:getcwd",
               "maker.num_makers=1", "trainer.total_steps=4", *SMALL], tmp_path)
    code, err = cli.wait()
    assert code != 0 and "getcwd" in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".run", "run"))] == ["run"]
    assert [p.name for p in run.iterdir()] == ["config.yaml"]
    assert (run / "config.yaml").read_text() == "name: the old run\n"  # the overwritten run is back, untouched
    assert cli.leaked == []
    print(f"failed before its first step: exit {code} after {time.monotonic() - started:.0f} s")

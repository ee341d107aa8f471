"""A sweep over two keys through `ray-ppo tune`, the tracking files, and the examples as users run them."""

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_processes import REPO, Cli, cluster_processes, kill_all

from ray_ppo.cluster.local_cluster import free_port
from ray_ppo.config import load_config

pytestmark = pytest.mark.e2e
SMALL = ["trainer.total_steps=3", "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8",
         "logging.report_every=1"]
EXAMPLE_SMALL = ["maker.num_makers=1", "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8"]
"""The examples take overrides as `ray-ppo train` does: one maker and small batches, a fit ~20 s shorter."""


def run(args, timeout=600, **kwargs):
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{args}\nSTDOUT:\n{proc.stdout[-2000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


def assert_png(path: Path) -> tuple[int, int]:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return image.shape[:2]


def test_ray_ppo_tune_sweeps_two_keys(tmp_path):
    # kl_coef over 2 values, eps_clip at a non-default 1 (2 trials, ~45 s each on 2 cores): both
    # --grid flags reach the trials; that two grid keys reach Tune as a product of grid_search
    # lists is checked in tests/unit/test_cli.py, and the product itself is Tune's.
    out = tmp_path / "sweep"
    proc = run([sys.executable, "-m", "ray_ppo.cli", "tune", "--config", "configs/tiny.yaml",
                "--grid", "ppo.kl_coef=0.02,0.1", "--grid", "ppo.eps_clip=0.1", "--max-concurrent", "2",
                "--output", str(out), *SMALL, "trainer.total_steps=2", "maker.num_makers=1"], timeout=900)
    with open(out / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    assert len(trials) == 2 and {t["status"] for t in trials} == {"TERMINATED"}
    assert {(t["ppo.kl_coef"], t["ppo.eps_clip"]) for t in trials} == {("0.02", "0.1"), ("0.1", "0.1")}
    assert all(t["step"] in ("2", "2.0") for t in trials)
    best_line = [line for line in proc.stdout.splitlines() if line.startswith("best: ")]
    assert len(best_line) == 1 and "reward_mean=" in best_line[0] and "checkpoint" in best_line[0]
    assert "rank" in proc.stdout  # the ranking table
    # at a glance: one line per finished trial (Tune's status tables are off), the ranking, the best
    finished = [line for line in proc.stdout.splitlines() if line.startswith("trial ")]
    assert len(finished) == 2 and all(" done: kl_coef=" in line and "reward_mean" in line for line in finished)
    assert [line.split(" done")[0] for line in finished] == ["trial 1/2", "trial 2/2"]
    assert "worker processes have been started" not in proc.stdout + proc.stderr  # the raylet's worker-count warning
    assert "Configuration for experiment" not in proc.stdout  # nor Tune's header and paths
    assert_png(out / "sweep.png")
    for trial in trials:  # each trial has its own run directory with curves and metrics
        run_dir = Path(trial["run_dir"])
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
        assert_png(run_dir / "curves.png")


def test_example_fit_from_script(tmp_path):
    proc = run([sys.executable, "examples/fit_from_script.py", "--steps", "3", "--output", str(tmp_path / "fit"),
                *EXAMPLE_SMALL])
    assert "steps=3 reward" in proc.stdout
    # quiet: Ray's start-up lines, the resource plan and the result; no Ray Data plan logging, and no
    # placement-group cleaner traceback ("Found multiple active Ray instances") beside another cluster
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "multiple active Ray instances" not in output
    assert "Execution plan of Dataset" not in output and len(output.splitlines()) <= 8, output


def test_example_tune_sweep(tmp_path):
    # a 1 x 1 grid keeps CI short: a grid over two keys is exercised by test_ray_ppo_tune_sweeps_two_keys
    proc = run([sys.executable, "examples/tune_sweep.py", "--steps", "2", "--kl-coefs", "0.001",
                "--eps-clips", "0.2", "--output", str(tmp_path / "sweep"), *EXAMPLE_SMALL], timeout=900)
    trials = [line for line in proc.stdout.splitlines() if line.startswith("trial ")]
    assert len(trials) == 1 and trials[0].startswith("trial 1/1 done: kl_coef=0.001, eps_clip=0.2 | reward_mean ")
    assert "best {'ppo.kl_coef'" in proc.stdout
    configs = list((tmp_path / "sweep").rglob("config.yaml"))  # the trial's run directory
    assert len(configs) == 1 and load_config(configs[0]).maker.num_makers == 1  # the overrides reached the trial


def stop_cluster(temp_dir: str) -> None:
    """Stop the processes of one cluster only (``ray_processes``)."""
    kill_all(cluster_processes(temp_dir))


@pytest.fixture(scope="module")
def head_node():
    """A one-node Ray cluster started with `ray start --head` on loopback, stopped afterwards."""
    import tempfile

    ray_bin = Path(sys.executable).parent / "ray"
    port, dashboard = "6390", "8275"
    temp_dir = tempfile.mkdtemp(prefix="rp_head_", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    start = [str(ray_bin), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=8", "--disable-usage-stats",
             # Not the default 52365: an agent of a cluster an earlier test stopped can hold it for a while,
             # and then this head's agent serves no HTTP, so jobs hang (seen: "address already in use").
             f"--dashboard-agent-listen-port={free_port()}"]
    # The job's entrypoint runs `python` from the head's PATH: put this venv first, as a cluster
    # image would have its Python with ray_ppo installed.
    env = {**os.environ, "PATH": f"{ray_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(start, check=True, capture_output=True, text=True, timeout=600, env=env)  # minutes when loaded
    try:
        yield {"dashboard": f"http://127.0.0.1:{dashboard}", "gcs": f"127.0.0.1:{port}"}
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)  # the head's logs and session files


def test_example_submit_job(head_node, tmp_path):
    # A run directory of its own: ray-ppo refuses one that holds an earlier run (a second CI run on one machine).
    proc = run([sys.executable, "examples/submit_job.py", "--address", head_node["dashboard"], "--steps", "2",
                "--output", str(tmp_path / "job"), *EXAMPLE_SMALL], timeout=900)
    assert "SUCCEEDED" in proc.stdout and "done: 2 steps" in proc.stdout
    assert load_config(tmp_path / "job" / "config.yaml").maker.num_makers == 1  # the overrides reached the job


def run_actors(gcs: str) -> list[str]:
    """The namespaces of ray_ppo's named actors alive on the cluster at ``gcs`` (from a driver of its own)."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps(sorted({a['namespace'] for a in ray.util.list_named_actors(all_namespaces=True) "
            "if a['namespace'].startswith('ray_ppo.')})))" % gcs)
    # `ray start --head` turned on token authentication: a plain driver attaches in token mode.
    proc = run([sys.executable, "-c", code], timeout=300, env={**os.environ, "RAY_AUTH_MODE": "token"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_killed_driver_on_a_shared_cluster_leaves_no_actors(head_node, tmp_path):
    """kill -9 of `ray-ppo train --address ...`: its coordinator and makers go with it (they
    belong to the driver), instead of holding the shared cluster's CPUs."""
    out = tmp_path / "run"
    cli = subprocess.Popen([sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml",
                            "--address", head_node["gcs"], "--output", str(out), *SMALL, "trainer.total_steps=50"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.txt", "w"))
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert cli.poll() is None and time.monotonic() < deadline, \
                f"the run ended or did not train a step: {(tmp_path / 'stderr.txt').read_text()[-3000:]}"
            time.sleep(0.5)
        assert run_actors(head_node["gcs"]) != []  # the run's coordinator and makers are up
    finally:
        cli.kill()  # SIGKILL: no clean-up of any kind
        cli.wait()
    deadline = time.monotonic() + 60
    while (left := run_actors(head_node["gcs"])) and time.monotonic() < deadline:
        time.sleep(2)
    assert left == [], f"actors left on the cluster after the driver died: {left}"


def test_a_run_on_a_shared_cluster_prints_only_its_own_lines(head_node, tmp_path):
    """`ray-ppo train --address ...` prints its resource plan, a line per step and its summary:
    none of the metrics dicts Ray Train's workers log, nor a line per maker call that Ray retries
    when the run's end kills the makers ("Task MakerWorker.send_loop failed ... killed by
    `ray.kill`"), nor a traceback of any process on the cluster."""
    proc = run([sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml",
                "--address", head_node["gcs"], "--output", str(tmp_path / "run"), *SMALL, "trainer.total_steps=2",
                "maker.num_makers=1"], env={**os.environ, "RAY_AUTH_MODE": "token"})
    sized = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint of step ")]
    lines = [line for line in proc.stdout.splitlines() if line not in sized]
    assert len(sized) == 1, proc.stdout  # the first checkpoint's size, said once
    assert [line.split(" ", 1)[0] for line in lines] == ["resources:", "step", "step", "done:"], proc.stdout
    assert lines[1].startswith("step 1/2 | ") and lines[2].startswith("step 2/2 | ")
    for noise in ("{'", "MakerWorker", "ray.kill", "Unhandled error", "Traceback"):
        assert noise not in proc.stdout + proc.stderr, f"{noise!r} printed:\n{proc.stdout}\n{proc.stderr}"


def test_ctrl_c_stops_an_async_search_instead_of_confirming_a_pick(tmp_path):
    """Ctrl-C while a search trial trains: `ray-ppo tune --async-search` exits 130 with one line
    naming its directory, starts no confirmation, and leaves no process of its cluster behind.
    (Tune's own SIGINT handler returned the half-run search as if done: the CLI went on to confirm
    a pick from it and printed a gain of nan.)"""
    out = tmp_path / "search"
    cli = Cli("tune", ["--config", "configs/tiny.yaml", "--async-search", "60", "--num-samples", "2",
                       "--max-concurrent", "1", "--output", str(out), "trainer.total_steps=1000",
                       "logging.report_every=1"], tmp_path)
    try:
        cli.wait_until(lambda: any(p.read_text().strip() for p in (out / "search" / "trials").glob("*/metrics.jsonl")),
                       timeout_s=300)  # a search trial trained a step
        sent = time.monotonic()
        cli.interrupt()
        code, stderr = cli.wait(timeout_s=120)
        stop_s = time.monotonic() - sent
    finally:
        cli.close()
    assert code == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"ray-ppo tune: interrupted; the trials that ran are in {out} "
                                               "(run the command again to search again)")
    stdout = cli.stdout()
    assert "confirm:" not in stdout and "recommended:" not in stdout and not (out / "confirm").exists()
    assert stop_s < 60 and cli.leaked == []
    print(f"Ctrl-C during the search: exit 130 after {stop_s:.1f} s")

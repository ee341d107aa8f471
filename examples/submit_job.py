"""Submit a detached PPO run to a running Ray cluster with Ray's JobSubmissionClient.

Start a cluster first (keep it on a private network, dashboard on loopback or behind your
own proxy; this script sends Ray's auth token when one is set up):

    ray start --head --dashboard-host 127.0.0.1 --num-cpus 8
    python examples/submit_job.py --address http://127.0.0.1:8265 [--steps 5] [KEY=VALUE ...]
    ray stop

The job's runtime environment carries this repository as its working directory, so the
entrypoint finds `configs/` and `data/`; ray_ppo itself must be installed on the cluster's
nodes (or add it to runtime_env["pip"] where the nodes can reach a package index).
"""

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

# `ray start --head` turns on Ray's token authentication and keeps the token in
# ~/.ray/auth_token; the job client sends it only in token mode.
if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (Path.home() / ".ray" / "auth_token").exists():
    os.environ.setdefault("RAY_AUTH_MODE", "token")

from ray.job_submission import JobStatus  # noqa: E402

from ray_ppo.cluster.readiness import job_client, submit_job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="http://127.0.0.1:8265", help="the cluster's dashboard address")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=600, help="how long the job may run")
    parser.add_argument("--ready-timeout-s", type=float, default=None,
                        help="how long to wait for the cluster's dashboard and job agent to come up "
                             "(default: $RAY_PPO_SERVICE_READY_TIMEOUT_S, else 600)")
    parser.add_argument("--output", default=None,
                        help="the run directory on the cluster (default: a new /tmp/ray_ppo_job-<time>; ray-ppo refuses "
                             "a directory that already holds a run)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, as `ray-ppo train` takes them (e.g. maker.num_makers=1)")
    args = parser.parse_args()
    output = args.output or f"/tmp/ray_ppo_job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    client = job_client(args.address, args.ready_timeout_s)
    job_id = submit_job(client, args.ready_timeout_s, entrypoint=shlex.join([
        "python", "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml", "--address", "auto",
        "--output", output, f"trainer.total_steps={args.steps}", *args.overrides]), runtime_env={
        "working_dir": str(REPO), "excludes": [".venv", ".venv-colossalai", ".venv-vllm", ".venv-trl", "runs", ".git",
                                               "*.egg-info", "tests"]})
    print(f"submitted {job_id} (run directory {output})")
    deadline = time.monotonic() + args.timeout_s
    while (status := client.get_job_status(job_id)) not in TERMINAL:
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            print(f"job {job_id} still {status} after {args.timeout_s:.0f} s; stopped it", file=sys.stderr)
            return 1
        time.sleep(2)
    logs = client.get_job_logs(job_id).splitlines()
    print("\n".join([line for line in logs if line.startswith(("step ", "done:", "ray-ppo"))][-3:] or logs[-20:]))
    print(f"job {job_id}: {status}")
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())

"""``examples/fit_from_script.py`` as a user runs it, timed from the command's start.

    python benchmarks/example_startup.py [--repeats 2] [--repo DIR]

The example gives ``PPOTrainer`` a dataset of its own (``ray.data.read_csv``), starts its own
local cluster and trains 3 steps with one maker. Each run's output lines are timestamped as they
come; the table gives, per run, when the coordinator's read of the prompts ended and how long it
took (Ray Data's "execution finished in" line, which the example's driver shows), when the
example printed its result line, and when it exited. ``--repo`` runs another checkout's example
and code (e.g. a ``git worktree`` of an older commit) with this Python, for a before/after.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401
from _common import ROOT, publish

SMALL = ["maker.num_makers=1", "trainer.train_batch_size=16", "trainer.mini_batch_size=8", "maker.batch_size=8"]
READ = re.compile(r"\(CoordinatorActor.*execution finished in ([0-9.]+) seconds")


def timed_run(repo: Path, output: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, str(repo / "examples" / "fit_from_script.py"), "--steps", "3", "--output", output, *SMALL]
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    row = {"coordinator's read s": None, "read ended at s": None, "result line at s": None}
    for line in proc.stdout:
        now = round(time.monotonic() - start, 1)
        if (m := READ.search(line)) is not None:
            row["coordinator's read s"], row["read ended at s"] = float(m.group(1)), now
        elif line.startswith("steps=3 reward"):
            row["result line at s"] = now
    proc.wait()
    row["exit at s"] = round(time.monotonic() - start, 1)
    if proc.returncode != 0:
        raise SystemExit(f"the example failed with status {proc.returncode}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--repo", default=str(ROOT), help="checkout whose example and ray_ppo run (default: this one)")
    args = ap.parse_args()
    repo = Path(args.repo).resolve()
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="example_startup_") as out:
            rows.append({"run": i + 1, **timed_run(repo, out)})
            print(f"run {i + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"\nexamples/fit_from_script.py --steps 3 ({', '.join(SMALL)}) from {repo}\n")
    headers = list(rows[0])
    publish("example_startup", headers, [[r[h] for h in headers] for r in rows], args=args)


if __name__ == "__main__":
    main()

"""Several `ray-ppo train` runs started at the same moment on one machine, round after round: each
must start and finish (tests/e2e/test_startup.py runs one round in `make test`).

    python scripts/concurrent_runs.py [--rounds 10] [--runs 4] [--steps 2]

Prints a line per round (each run's exit status and wall time) and a summary; exits 1 if any run
failed or outlived --timeout-s. Each run is the tiny demo with one maker and small batches.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_round(runs: int, steps: int, timeout_s: float, work: Path) -> list[tuple[int, float]]:
    """(exit status, wall seconds) of each of ``runs`` runs started together; status -9: timed out."""
    procs, started = [], time.monotonic()
    for i in range(runs):
        command = [sys.executable, "-m", "ray_ppo.cli", "train", "--config", "configs/tiny.yaml",
                   "--output", str(work / f"run{i}"), "--overwrite", f"trainer.total_steps={steps}",
                   "trainer.train_batch_size=8", "trainer.mini_batch_size=8", "trainer.ppo_epochs=1",
                   "maker.batch_size=4", "maker.num_makers=1", "logging.progress=false"]
        log = open(work / f"run{i}.log", "w")
        procs.append((subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        results.append((proc.returncode, time.monotonic() - started))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--runs", type=int, default=4, help="runs started at once in each round")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=900, help="how long a round may take")
    args = parser.parse_args()
    walls, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="concurrent_runs_") as work:
        for round_ in range(1, args.rounds + 1):
            results = one_round(args.runs, args.steps, args.timeout_s, Path(work))
            failed += sum(code != 0 for code, _ in results)
            walls += [wall for _, wall in results]
            cells = "  ".join(f"rc {code} {wall:5.0f} s" for code, wall in results)
            print(f"round {round_:2d}: {cells}", flush=True)
            if any(code != 0 for code, _ in results):  # the failed runs' last lines
                for i, (code, _) in enumerate(results):
                    if code != 0:
                        print("  " + "".join((Path(work) / f"run{i}.log").read_text().splitlines(True)[-5:]))
    print(f"{args.rounds} rounds x {args.runs} runs: {len(walls) - failed} finished, {failed} failed | wall per run "
          f"median {statistics.median(walls):.0f} s, max {max(walls):.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Stopping and resuming `ray-ppo train` as a user does: Ctrl-C, `kill -9` of the driver, a run
that fails before its first step, a reused run directory, a finished run.

Each CLI run is a subprocess with its own local Ray cluster under a temporary directory of its
own (RAY_TMPDIR), so the test can check that no process of that cluster outlives the driver,
and kill (by pid) any that does before failing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from ray_processes import REPO, RUN_TIMEOUT_S, Cli

pytestmark = pytest.mark.e2e
SMALL = ["trainer.train_batch_size=8", "trainer.mini_batch_size=8", "trainer.ppo_epochs=1", "maker.batch_size=4",
         "trainer.checkpoint_every=2", "trainer.pull_timeout_s=300", "logging.progress=false"]
STOP_LIMIT_S = 45
"""Ctrl-C to exit, including Ray's shutdown (seconds; ~10 s on an idle machine, more under load)."""
STREAMING = ["maker.max_running=6", "maker.samples_per_prompt=2", "algo.advantage=grpo",
             "maker.weight_updates=in_flight", "maker.max_new_tokens=48"]
"""Streaming makers (continuous batching; each prompt's group is sent as it finishes), as
``tests/ray/test_pipeline.py`` runs them."""


def prompts_csv(tmp_path: Path, n: int) -> Path:
    """The first ``n`` toy prompts as a CSV of their own (prompt ids are rows 0..n-1 of it)."""
    lines = (REPO / "data" / "toy_prompts.csv").read_text().splitlines()
    path = tmp_path / f"prompts{n}.csv"
    path.write_text("\n".join(lines[:n + 1]) + "\n")
    return path


def steps_in(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def versions_in(run: Path) -> list[int]:
    return [json.loads(line)["policy_version"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def rows_in(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def prompts_trained_in(run: Path) -> list[int]:
    return [json.loads(line)["prompts_trained"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_state(run: Path) -> dict | None:
    try:
        return json.loads((run / "checkpoint" / "state.json").read_text())
    except (OSError, ValueError):
        return None


def in_flight(state: dict) -> int:
    """Prompts a checkpoint's ledger counts as handed out but not trained (a resume serves them again)."""
    return state["data"]["next"] - state["data"]["watermark"] - len(state["data"]["done"])


def past_checkpoint(run: Path, after: int = 0, holding_prompts: bool = False):
    """True once RUN_DIR/checkpoint holds a step > ``after`` (and, with ``holding_prompts``,
    prompts in flight) and a later step was trained."""
    def check() -> bool:
        state = checkpoint_state(run)
        return (state is not None and state["step"] > after and max(steps_in(run), default=0) > state["step"]
                and (in_flight(state) > 0 or not holding_prompts))
    return check


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("streaming", [False, True], ids=["batches", "streaming"])
def test_ctrl_c_then_kill_9_and_two_resumes_train_every_prompt_exactly_once(tmp_path, streaming):
    """Ctrl-C stops the run cleanly; its resume is killed with kill -9 (no clean-up of any kind);
    a second resume runs to the end. 3 makers generate, so prompts are in flight at each stop. By
    prompt identity, every prompt of the first epoch is trained exactly once, and no prompt twice;
    steps and policy versions go on from each checkpoint. Then the finished run has nothing to do,
    and a new run refuses its directory. (One run through both stops: each CLI run starts a
    cluster of its own, ~40 s of the suite.)

    Streaming makers (``maker.max_running``) hold prompts whose sequences are running or waiting
    in their batchers at any time: their run is killed with kill -9 (the stop that saves nothing)
    and resumed once, with the same checks (the Ctrl-C path and what follows the end do not depend
    on the makers: two CLI runs, not five)."""
    # Steps take well under a second here, RUN_DIR/checkpoint follows the run by a poll or two,
    # and Ctrl-C stops it a few steps later (seen: interrupted after step 8, checkpoint of step 6);
    # the kill then needs a later checkpoint and a step after it: 20 steps hold both. 20 x 8 items
    # are the first epoch of 96 prompts and two thirds of the second, all in the checkpoint's log
    # of trained prompts (it keeps the current and the previous epoch). Streaming: 2 items a prompt,
    # 4 prompts a step; the kill needs a checkpoint and a step after it, and 8 steps are the first
    # epoch of 24 prompts and a third of the second.
    n_prompts, total, per_step = (24, 8, 4) if streaming else (96, 20, 8)
    run = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", "--output", str(run), f"data.path={prompts_csv(tmp_path, n_prompts)}",
            "maker.num_makers=3", f"trainer.total_steps={total}", *SMALL, *(STREAMING if streaming else ())]
    cli = Cli("train", args, tmp_path)
    interrupted = []
    if not streaming:
        cli.wait_until(past_checkpoint(run))
        sent = time.monotonic()
        cli.interrupt()
        code, err = cli.wait()
        stop_s = time.monotonic() - sent
        interrupted.append(checkpoint_state(run))
        saved, last = interrupted[0]["step"], max(steps_in(run))
        assert code == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == (f"ray-ppo train: interrupted after step {last}; {run}/checkpoint holds "
                                                f"step {saved}: resume with: ray-ppo train --resume {run}")
        assert stop_s < STOP_LIMIT_S and cli.leaked == []
        print(f"Ctrl-C at step {last}: exit 130 after {stop_s:.1f} s; checkpoint at step {saved}")
        cli = Cli("train", ["--resume", str(run)], tmp_path)

    # Streaming: kill -9 after a checkpoint taken while prompts were in flight (one may hold none:
    # seen at step 2, when no maker had been admitted for the next step's prompts yet).
    cli.wait_until(past_checkpoint(run, after=interrupted[-1]["step"] if interrupted else 0, holding_prompts=streaming))
    cli.kill()
    cli.wait()
    assert cli.leaked == []  # the local cluster died with its driver (Ray's agents a minute later)
    interrupted.append(checkpoint_state(run))

    cli = Cli("train", ["--resume", str(run)], tmp_path)
    code, err = cli.wait()
    assert code == 0 and cli.leaked == [], err[-3000:]
    out, resumed_at = cli.stdout().splitlines(), interrupted[-1]["step"]
    assert f"resuming {run} from step {resumed_at} (checkpoint {run}/checkpoints/step_{resumed_at:08d})" in out
    assert out[-1].startswith(f"done: {total} steps (steps {resumed_at + 1}-{total} in this process, "
                              f"{total - resumed_at} steps) in "), out[-1]
    # the ledger's count at each step, over all the processes (one group of items per prompt, none blank)
    assert prompts_trained_in(run) == [per_step * step for step in range(1, total + 1)]
    held = [in_flight(s) for s in interrupted]
    assert sum(held) > 0  # prompts handed out but not trained when the checkpoints were taken
    final = checkpoint_state(run)
    assert final["step"] == total
    assert steps_in(run) == list(range(1, total + 1))  # rows after each checkpoint were redone, not doubled
    assert versions_in(run) == list(range(1, total + 1))  # the policy version went on from each checkpoint's
    trained = [pid for _, ids in final["data"]["trained"] for pid in ids]
    assert len(trained) == total * per_step == len(set(trained)), "a prompt was trained twice"
    assert set(range(n_prompts)) <= set(trained), f"never trained: {sorted(set(range(n_prompts)) - set(trained))}"
    steps_of = {step for step, _ in final["data"]["trained"]}
    assert steps_of == set(range(1, total + 1))  # the log spans every process's steps
    rows = rows_in(run)
    assert rows[-1]["weights_in_sync"] == 1.0  # the resumed makers hold the last push (fingerprints checked)
    print(f"stopped at checkpoints {[s['step'] for s in interrupted]} with {held} prompts in flight; "
          f"{len(trained)} prompts trained, each once")
    if streaming:
        # the rows of streaming makers (from every process): the makers did stream
        assert all("maker_sequences_running" in row for row in rows)
        return

    started = time.monotonic()
    cli = Cli("train", ["--resume", str(run), f"trainer.total_steps={total}"], tmp_path)
    code, err = cli.wait()
    assert code == 0 and time.monotonic() - started < 60  # no Ray cluster was started
    assert cli.stdout().strip() == (f"run {run} has already trained {total} steps (trainer.total_steps={total}): "
                                    f"nothing to do; to train further: ray-ppo train --resume {run} "
                                    f"trainer.total_steps={2 * total}")

    before = (run / "metrics.jsonl").read_text()
    started = time.monotonic()
    code, err = Cli("train", ["--config", "configs/tiny.yaml", "--output", str(run)], tmp_path).wait()
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
    cli = Cli("train", ["--config", "configs/tiny.yaml", "--output", str(run), "--overwrite", "model.reward_fn=os:getcwd",
               "maker.num_makers=1", "trainer.total_steps=4", *SMALL], tmp_path)
    code, err = cli.wait()
    assert code != 0 and "getcwd" in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".run", "run"))] == ["run"]
    assert [p.name for p in run.iterdir()] == ["config.yaml"]
    assert (run / "config.yaml").read_text() == "name: the old run\n"  # the overwritten run is back, untouched
    assert cli.leaked == []
    print(f"failed before its first step: exit {code} after {time.monotonic() - started:.0f} s")


def test_a_run_dir_of_30ca318_resumes(tmp_path):
    """A run directory written before the code was laid out by role (``tests/fixtures/run_30ca318``:
    two steps of configs/tiny.yaml) trains on from its checkpoint with today's ``ray-ppo train``."""
    import shutil

    run = tmp_path / "old_run"
    shutil.copytree(REPO / "tests" / "fixtures" / "run_30ca318", run, symlinks=True)
    cli = Cli("train", ["--resume", str(run), "trainer.total_steps=3", "logging.progress=false"], tmp_path)
    code, err = cli.wait()
    assert code == 0, err
    assert "from step 2" in cli.stdout() and steps_in(run) == [1, 2, 3]
    assert checkpoint_state(run)["step"] == 3 and cli.leaked == []

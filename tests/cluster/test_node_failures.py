"""Node failures on a simulated multi-node cluster: one run loses its trainer's node, then its
makers' node, and survives both.

A ``ray.cluster_utils.Cluster`` is a set of raylets of its own and a driver can be connected to
one cluster only, so the scenario runs in a subprocess (this file run as a script) and writes
what it saw as JSON; the test asserts on that. This keeps it apart from the session cluster of
tests/ray, whichever order pytest runs them in. One run takes both faults, because each run
costs a cluster and a fit (~90 s on 2 cores).

Layout: the head node runs the driver, the coordinator and Ray Train's controller; one node
advertises ``trainer_node`` (the worker group), one ``maker_node`` (both makers). Once the
makers are up, a spare maker node joins; once a step is trained (the worker group placed), a
spare trainer node. Then, each node killed with no graceful shutdown (like a
lost machine):

1. **The trainer's node**, once a checkpoint is stored and a later step trained: with
   ``trainer.max_failures=1`` Ray Train restarts the worker group on the spare trainer node from
   that checkpoint; the prompts trained after it are served again, so every prompt is still
   trained exactly once. This fault comes first: it must land between a checkpoint and the end
   of the run, which is easiest while the run is young.
2. **The makers' node**, two policy versions after the restarted group's first: Ray restarts
   the makers on the spare maker node (``maker.max_restarts``), the coordinator counts what died
   with them and resends the latest weights, and the run finishes every step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scenario import END_MARGIN_S, POLL_S, coordinator_status, fit_recording_error, record_end_of_fit, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster
REPO = Path(__file__).parents[2]
TOTAL_STEPS = 12
NUM_MAKERS = 2
MAKER_NODE = {"num_cpus": 1, "resources": {"maker_node": NUM_MAKERS}}  # room for every maker (0.5 CPU each)
TRAINER_NODE = {"num_cpus": 1, "resources": {"trainer_node": 1}}
NODE_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
"""The GCS declares a silent node dead after ~3 s (Ray's defaults, 3000 ms x 5, take ~15 s)."""
MAKERS_KILLED_AFTER = 2
"""Policy versions the restarted worker group trains before the makers' node is killed."""
SCENARIO_TIMEOUT_S = 1500
"""~2.5 min on a quiet machine. Beside two busy loops (make test under load) rank 0 took ~290 s to
restart on the spare node (five raylets, models built twice, a worker group restarted), and the
makers longer than 120 s to restart on theirs, so the run's pull_timeout_s is 600."""


@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 60)
def test_trainer_node_then_makers_node_lost_midrun_are_survived(tmp_path):
    out = tmp_path / "node_failures.json"
    temp_dir = tempfile.mkdtemp(prefix="rp_node_", dir="/tmp")  # short: Ray's socket paths have a length limit
    # RAY_TMPDIR: the cluster's session files and its address file stay out of /tmp/ray, where a
    # plain ray.init() of any other process on this machine would find and join it.
    env = {**os.environ, "RAY_TMPDIR": temp_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, __file__, str(out), str(tmp_path / "run")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # the scenario gives up END_MARGIN_S before this, and says why
        pytest.fail(f"the scenario timed out; it got as far as: {out.read_text() if out.exists() else 'nothing'}; "
                    f"its stderr ends: {_text(e.stderr)[-3000:]}", pytrace=False)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    seen = json.loads(out.read_text()) if out.exists() else {}
    if seen.get("error") is not None or proc.returncode != 0:  # no traceback: CI shows a failure's first lines
        pytest.fail(f"{seen.get('error')}; last coordinator status: {seen.get('last_status')}; "
                    f"exit {proc.returncode}; stderr ends: {proc.stderr[-3000:]}", pytrace=False)

    steps = [m["step"] for m in seen["history"]]
    versions = [m["policy_version"] for m in seen["history"]]
    assert steps[-1] == TOTAL_STEPS and versions == sorted(versions)
    assert seen["history"][-1]["weights_in_sync"] == 1.0  # the restarted makers hold the last push
    nodes = seen["nodes"]

    # 1. The trainer's node: the group restarted on the spare from the checkpoint, steps after it ran again.
    assert len(steps) > len(set(steps))
    assert seen["rank_nodes"] == [nodes["trainer"], nodes["trainer_spare"]]
    final = seen["final_checkpoint"]
    assert final["step"] == TOTAL_STEPS
    trained = [pid for _, ids in final["data"]["trained"] for pid in ids]
    # exactly once: the prompts trained by the lost worker group after the checkpoint were
    # served again (rewound), and the log holds each prompt once, over steps 1..TOTAL_STEPS
    assert len(trained) == len(set(trained)) == TOTAL_STEPS * seen["train_batch_size"]
    assert {s for s, _ in final["data"]["trained"]} == set(range(1, TOTAL_STEPS + 1))
    c = seen["final_status"]["counters"]
    assert c["prompts_requeued"] >= seen["trained_after_checkpoint"] > 0

    # 2. The makers' node: the makers restarted on the spare, once each, and resynced.
    assert seen["coordinator_node"] == nodes["head"]  # pinned to the driver's node, so it survived
    assert {m["NodeID"] for m in seen["makers_before"].values()} == {nodes["makers"]}
    assert {m["NodeID"] for m in seen["makers_after"].values()} == {nodes["makers_spare"]}
    assert all(m["NumRestarts"] == 1 for m in seen["makers_after"].values())
    assert all(m["restarts"] == 1 for m in seen["final_status"]["makers"].values())  # each resynced once
    assert c["produced"] == c["consumed"] + c["in_flight"] + c["discarded"] + c["lost_in_transit"]
    # Every prompt handed out is accounted for: it came back as an item, was blank, or died
    # with the node (counted as lost, not silently dropped: before the coordinator ended the
    # dead makers' waiting next_prompts calls, their batches went nowhere, uncounted).
    assert c["prompts_served"] == c["produced"] + c["blank_prompts"] + c["lost"]
    assert seen["recovery"]["recovered_step_s"] is not None  # trained on experience made after the restart
    print(f"trainer node lost after step {seen['killed_after_step']} (checkpoint at step {seen['checkpoint_step']}); "
          f"{seen['trained_after_checkpoint']} prompts rewound; restarted on the spare node in {seen['restart_s']:.1f} s. "
          f"Makers' node: lost {c['lost']} prompts and {c['lost_in_transit']} items in transit, discarded "
          f"{c['discarded']} items; after the node was killed: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in seen["recovery"].items() if v is not None)
          + f"; scenario {seen['scenario_s']:.0f} s")


def _text(output: bytes | str | None) -> str:
    """What a timed-out ``subprocess.run`` captured: bytes even with ``text=True``, or None."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# -- the scenario (runs in the subprocess) --------------------------------------------------------

def run_scenario(out_path: str, run_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from ray_ppo.api import PPOTrainer
    from ray_ppo.config import load_config

    start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "_system_config": NODE_HEALTH_CHECK})
    try:
        trainer_node = cluster.add_node(**TRAINER_NODE)
        makers_node = cluster.add_node(**MAKER_NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config(REPO / "configs" / "tiny.yaml", [
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.train_batch_size=8", "trainer.mini_batch_size=8",
            "trainer.ppo_epochs=1", "trainer.pull_timeout_s=600", "trainer.node_resource=trainer_node",
            "trainer.checkpoint_every=2", "trainer.max_failures=1",
            f"maker.num_makers={NUM_MAKERS}", "maker.batch_size=4", "maker.node_resource=maker_node",
            "maker.max_restarts=1", "logging.report_every=1", f"logging.output_dir={run_dir}",
            # Makers may run 4 versions ahead: the trainer goes on with what is buffered while
            # they restart, and they often hold made batches when their node dies (lost > 0;
            # whether they do depends on timing, so only the accounting is asserted).
            "ppo.max_staleness=4",
            # By ref, batches the makers sent live in the dead node's object store: lost in
            # transit (counted, and replaced by the rank) unless a rank had read them already.
            "topology.transport=ref"])
        trainer = PPOTrainer(cfg)  # its RunConfig has controller_failure_limit=0: fails, never hangs
        seen = {"train_batch_size": cfg.trainer.train_batch_size, "error": None}
        save = lambda: Path(out_path).write_text(json.dumps({**seen, "history": trainer.history}, default=str))  # noqa: E731
        fit = threading.Thread(target=fit_recording_error, args=(trainer, seen), daemon=True)
        fit.start()  # Cluster.add_node/remove_node only work from the main thread
        deadline = start + SCENARIO_TIMEOUT_S - END_MARGIN_S
        checkpoint = Path(run_dir) / "checkpoint" / "state.json"  # the published checkpoint's state
        try:
            _run_faults(cluster, trainer, fit, seen, save, deadline, checkpoint, trainer_node, makers_node)
        except Exception as e:  # the test fails with what the scenario saw, not with a bare timeout
            seen["error"] = f"{type(e).__name__}: {e}" + (f"; fit() failed with {seen['error']}" if seen["error"] else "")
            seen["last_status"] = coordinator_status(trainer)
            seen["makers_now"] = _makers()
            save()
            raise
        record_end_of_fit(trainer, seen, fit, deadline)
        seen.update(makers_after=_makers(), coordinator_node=seen["final_status"] and seen["final_status"]["node_id"],
                    final_checkpoint=json.loads(checkpoint.read_text()),
                    scenario_s=time.monotonic() - start)
        Path(out_path).write_text(json.dumps(seen, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run_faults(cluster, trainer, fit, seen: dict, save, deadline: float, checkpoint: Path,
                trainer_node, makers_node) -> None:
    """The two node losses, each once the run reached the stage it needs; records what it saw."""
    wait_for("every maker alive", lambda: len(_makers()) == NUM_MAKERS and all(
        m["State"] == "ALIVE" for m in _makers().values()), fit, deadline)
    seen["makers_before"] = _makers()
    makers_spare = cluster.add_node(**MAKER_NODE)

    # 1. the trainer's node, between a stored checkpoint and the end of the run
    wait_for("a first trained step", lambda: len(trainer.history) >= 1, fit, deadline)
    rank_nodes = seen["rank_nodes"] = [_node_of(coordinator_status(trainer)["rank_pids"][0])]
    # The spare joins only now that rank 0 is placed: the worker group starts beside the makers,
    # and a spare that joined before it could take the group (seen in CI: after trainer_node was
    # removed at step 4 the run trained steps 5-12 over 16 s with no restart, so its rank was not
    # there, and the scenario stopped at "rank 0 restarted").
    trainer_spare = cluster.add_node(**TRAINER_NODE)
    seen["nodes"] = {"head": cluster.head_node.node_id, "trainer": trainer_node.node_id,
                     "trainer_spare": trainer_spare.node_id, "makers": makers_node.node_id,
                     "makers_spare": makers_spare.node_id}
    wait_for("a step trained after a stored checkpoint", lambda: checkpoint.exists() and (
        trainer.history[-1]["step"] > json.loads(checkpoint.read_text())["step"]), fit, deadline)
    saved = json.loads(checkpoint.read_text())
    status = coordinator_status(trainer)
    seen.update(checkpoint_step=saved["step"], killed_after_step=trainer.history[-1]["step"],
                trained_after_checkpoint=status["counters"]["prompts_trained"] - len(
                    [p for _, ids in saved["data"]["trained"] for p in ids]))
    save()
    killed_at = time.monotonic()
    cluster.remove_node(trainer_node, allow_graceful=False)
    old_pid = status["rank_pids"][0]
    wait_for("rank 0 restarted after its node was lost", lambda: coordinator_status(trainer).get(
        "rank_pids", {}).get(0) not in (None, old_pid), fit, deadline)
    seen["restart_s"] = time.monotonic() - killed_at
    rank_nodes.append(_node_of(coordinator_status(trainer)["rank_pids"][0]))
    save()

    # 2. the makers' node, once the restarted group has trained MAKERS_KILLED_AFTER versions
    restarted_at = coordinator_status(trainer)["trainer_version"]
    wait_for(f"{MAKERS_KILLED_AFTER} versions trained by the restarted group", lambda: coordinator_status(
        trainer).get("trainer_version", 0) >= restarted_at + MAKERS_KILLED_AFTER, fit, deadline)
    killed_at = time.monotonic()
    cluster.remove_node(makers_node, allow_graceful=False)
    seen["recovery"] = _watch_recovery(trainer, killed_at, fit, makers_node.node_id, deadline)
    save()


def _makers() -> dict[str, dict]:
    """Ray's record of each maker actor: node (its last one, once dead), state, restarts. The
    GCS actor table needs no dashboard (``ray.util.state`` does) and outlives ``fit()``."""
    import ray._private.state

    return {a["Name"]: {"NodeID": a["Address"]["NodeID"], "State": a["State"], "NumRestarts": a["NumRestarts"]}
            for a in ray._private.state.actors().values() if a["Name"].startswith("maker_")}


def _node_of(pid: int) -> str | None:
    """The node whose worker process has ``pid`` (the GCS's record of live actors and their pids)."""
    import ray._private.state

    for actor in ray._private.state.actors().values():
        if actor.get("Pid") == pid and actor["State"] == "ALIVE":
            return actor["Address"]["NodeID"]
    return None


def _watch_recovery(trainer, killed_at: float, fit: threading.Thread, dead_node: str, deadline: float) -> dict:
    """Seconds from the makers' node's death to: Ray declaring it dead; the trainer's next step
    (it may train on what was already buffered); the first maker back (process restarted, models
    loaded); its first item; the first step trained after that item arrived; every maker back on
    the weights the trainer had at the kill."""
    import ray

    before = coordinator_status(trainer)
    marks: dict[str, float | None] = dict.fromkeys(["node_dead_s", "next_step_s", "first_restart_s",
                                                    "first_new_item_s", "recovered_step_s", "all_resynced_s"])
    produced_at_restart = version_at_new_item = None
    while fit.is_alive() and None in marks.values() and time.monotonic() < deadline:
        status, now = coordinator_status(trainer), time.monotonic() - killed_at
        if not status:
            break
        if marks["node_dead_s"] is None and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == dead_node):
            marks["node_dead_s"] = now
        makers, produced, version = status["makers"].values(), status["counters"]["produced"], status["trainer_version"]
        if marks["next_step_s"] is None and version > before["trainer_version"]:
            marks["next_step_s"] = now
        if produced_at_restart is None and any(m["restarts"] for m in makers):
            marks["first_restart_s"], produced_at_restart = now, produced
        if produced_at_restart is not None and version_at_new_item is None and produced > produced_at_restart:
            marks["first_new_item_s"], version_at_new_item = now, version
        if version_at_new_item is not None and marks["recovered_step_s"] is None and version > version_at_new_item:
            marks["recovered_step_s"] = now
        if marks["all_resynced_s"] is None and all(
                m["restarts"] and m["version"] >= before["trainer_version"] for m in makers):
            marks["all_resynced_s"] = now
        time.sleep(POLL_S)
    return marks


if __name__ == "__main__":
    run_scenario(sys.argv[1], sys.argv[2])

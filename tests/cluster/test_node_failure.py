"""Node failure on a simulated multi-node cluster: the makers' node dies mid-run, the run survives.

A ``ray.cluster_utils.Cluster`` is a set of raylets of its own and a driver can be connected to
one cluster only, so the scenario runs in a subprocess (this file run as a script) and writes
what it saw as JSON; the test asserts on that. This keeps it apart from the session cluster of
tests/ray, whichever order pytest runs them in.

Layout: the head node runs the driver, the coordinator and Ray Train's controller; one node
advertises ``trainer_node`` (the worker group), one ``maker_node`` (both makers). Once the makers
are up, a spare ``maker_node`` node joins; after two trained steps the makers' node is killed
(no graceful shutdown, like a lost machine). Ray restarts the makers on the spare node
(``maker.max_restarts``), the coordinator counts what died with them and resends the latest
weights, and the run finishes every step.
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
from scenario import POLL_S, coordinator_status, fit_recording_error, record_end_of_fit, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster
REPO = Path(__file__).parents[2]
TOTAL_STEPS = 6
REMOVE_AT_VERSION = 2
NUM_MAKERS = 2
MAKER_NODE = {"num_cpus": 1, "resources": {"maker_node": NUM_MAKERS}}  # room for every maker (0.5 CPU each)
NODE_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
"""The GCS declares a silent node dead after ~3 s (Ray's defaults, 3000 ms x 5, take ~15 s)."""
SCENARIO_TIMEOUT_S = 300  # ~60 s on a quiet machine, ~190 s with both cores busy


@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 60)
def test_makers_node_lost_midrun_is_survived(tmp_path):
    out = tmp_path / "node_failure.json"
    temp_dir = tempfile.mkdtemp(prefix="rp_node_", dir="/tmp")  # short: Ray's socket paths have a length limit
    # RAY_TMPDIR: the cluster's session files and its address file stay out of /tmp/ray, where a
    # plain ray.init() of any other process on this machine would find and join it.
    env = {**os.environ, "RAY_TMPDIR": temp_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, __file__, str(out), str(tmp_path / "run")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    seen = json.loads(out.read_text())

    assert seen["error"] is None, seen["error"]
    steps = [m["step"] for m in seen["history"]]
    versions = [m["policy_version"] for m in seen["history"]]
    assert steps[-1] == TOTAL_STEPS and versions == sorted(versions)
    assert seen["history"][-1]["weights_in_sync"] == 1.0  # the restarted makers hold the last push

    nodes = seen["nodes"]
    assert seen["coordinator_node"] == nodes["head"]  # pinned to the driver's node, so it survived
    assert {m["NodeID"] for m in seen["makers_before"].values()} == {nodes["makers"]}
    assert {m["NodeID"] for m in seen["makers_after"].values()} == {nodes["spare"]}  # restarted there
    assert all(m["NumRestarts"] == 1 for m in seen["makers_after"].values())

    status = seen["final_status"]
    assert all(m["restarts"] == 1 for m in status["makers"].values())  # each resynced once
    c = status["counters"]
    assert c["produced"] == c["consumed"] + c["in_flight"] + c["discarded"] + c["lost_in_transit"]
    # Every prompt handed out is accounted for: it came back as an item, was blank, or died
    # with the node (counted as lost, not silently dropped: before the coordinator ended the
    # dead makers' waiting next_prompts calls, their batches went nowhere, uncounted).
    assert c["prompts_served"] == c["produced"] + c["blank_prompts"] + c["lost"]
    assert c["consumed"] == TOTAL_STEPS * seen["train_batch_size"]
    assert seen["recovery"]["recovered_step_s"] is not None  # trained on experience made after the restart
    print(f"node failure: lost {c['lost']} prompts and {c['lost_in_transit']} items in transit, discarded {c['discarded']} items; after the node was killed: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in seen["recovery"].items() if v is not None)
          + f"; scenario {seen['scenario_s']:.0f} s")


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
        cluster.add_node(num_cpus=1, resources={"trainer_node": 1})
        makers_node = cluster.add_node(**MAKER_NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config(REPO / "configs" / "tiny.yaml", [
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.train_batch_size=16", "trainer.mini_batch_size=8",
            "trainer.pull_timeout_s=60", "trainer.node_resource=trainer_node",
            f"maker.num_makers={NUM_MAKERS}", "maker.batch_size=8", "maker.node_resource=maker_node",
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
        fit = threading.Thread(target=fit_recording_error, args=(trainer, seen), daemon=True)
        fit.start()  # Cluster.add_node/remove_node only work from the main thread
        wait_for(lambda: len(_makers()) == NUM_MAKERS and all(m["State"] == "ALIVE" for m in _makers().values()), SCENARIO_TIMEOUT_S)
        seen["makers_before"] = _makers()
        spare = cluster.add_node(**MAKER_NODE)
        wait_for(lambda: coordinator_status(trainer).get("trainer_version", 0) >= REMOVE_AT_VERSION, SCENARIO_TIMEOUT_S)
        seen["nodes"] = {"head": cluster.head_node.node_id, "makers": makers_node.node_id, "spare": spare.node_id}
        seen["killed_after_s"] = time.monotonic() - start
        killed_at = time.monotonic()
        cluster.remove_node(makers_node, allow_graceful=False)
        seen["recovery"] = _watch_recovery(trainer, killed_at, fit, makers_node.node_id)
        record_end_of_fit(trainer, seen, fit, start, SCENARIO_TIMEOUT_S)
        seen.update(makers_after=_makers(), coordinator_node=seen["final_status"] and seen["final_status"]["node_id"],
                    scenario_s=time.monotonic() - start)
        Path(out_path).write_text(json.dumps(seen, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _makers() -> dict[str, dict]:
    """Ray's record of each maker actor: node (its last one, once dead), state, restarts. The
    GCS actor table needs no dashboard (``ray.util.state`` does) and outlives ``fit()``."""
    import ray._private.state

    return {a["Name"]: {"NodeID": a["Address"]["NodeID"], "State": a["State"], "NumRestarts": a["NumRestarts"]}
            for a in ray._private.state.actors().values() if a["Name"].startswith("maker_")}


def _watch_recovery(trainer, killed_at: float, fit: threading.Thread, dead_node: str) -> dict:
    """Seconds from the node's death to: Ray declaring it dead; the trainer's next step (it may
    train on what was already buffered); the first maker back (process restarted, models loaded);
    its first item; the first step trained after that item arrived; every maker back on the
    weights the trainer had at the kill."""
    import ray

    before = coordinator_status(trainer)
    marks: dict[str, float | None] = dict.fromkeys(["node_dead_s", "next_step_s", "first_restart_s",
                                                    "first_new_item_s", "recovered_step_s", "all_resynced_s"])
    produced_at_restart = version_at_new_item = None
    while fit.is_alive() and None in marks.values():
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

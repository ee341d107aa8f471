"""The trainer's node is lost on a simulated multi-node cluster: with ``trainer.max_failures=1``
Ray Train restarts the worker group on another node from the last checkpoint, the prompts
trained after that checkpoint are served again, and the run finishes with every prompt trained
exactly once.

Runs in a subprocess (this file as a script), as tests/cluster/test_node_failure.py does, and
for the same reasons. Layout: the head node runs the driver, the coordinator and Ray Train's
controller; one node advertises ``maker_node`` (both makers), one ``trainer_node`` (the worker
group). Once the first step is trained a spare ``trainer_node`` node joins; once a checkpoint
is stored and a later step trained, the trainer's node is killed (no graceful shutdown).
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
from scenario import coordinator_status, fit_recording_error, record_end_of_fit, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster
REPO = Path(__file__).parents[2]
TOTAL_STEPS = 6
NUM_MAKERS = 2
TRAINER_NODE = {"num_cpus": 1, "resources": {"trainer_node": 1}}
NODE_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
SCENARIO_TIMEOUT_S = 900  # minutes on a loaded 2-core machine: four raylets, the models built twice


@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 60)
def test_trainer_node_lost_midrun_restarts_from_the_checkpoint(tmp_path):
    out = tmp_path / "trainer_node_failure.json"
    temp_dir = tempfile.mkdtemp(prefix="rp_tnode_", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": temp_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, __file__, str(out), str(tmp_path / "run")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the scenario timed out; it got as far as: {out.read_text() if out.exists() else 'nothing'}")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["error"] is None, seen["error"]

    steps = [m["step"] for m in seen["history"]]
    versions = [m["policy_version"] for m in seen["history"]]
    assert steps[-1] == TOTAL_STEPS and versions == sorted(versions)
    assert len(steps) > len(set(steps))  # the steps after the checkpoint ran again, on the new node
    assert seen["rank_nodes"][0] == seen["nodes"]["trainer"] and seen["rank_nodes"][-1] == seen["nodes"]["spare"]
    assert seen["history"][-1]["weights_in_sync"] == 1.0

    final = seen["final_checkpoint"]
    assert final["step"] == TOTAL_STEPS
    trained = [pid for _, ids in final["data"]["trained"] for pid in ids]
    # exactly once: the prompts trained by the lost worker group after the checkpoint were
    # served again (rewound), and the log holds each prompt once, over steps 1..TOTAL_STEPS
    assert len(trained) == len(set(trained)) == TOTAL_STEPS * seen["train_batch_size"]
    assert {s for s, _ in final["data"]["trained"]} == set(range(1, TOTAL_STEPS + 1))
    assert seen["final_status"]["counters"]["prompts_requeued"] >= seen["trained_after_checkpoint"] > 0
    print(f"trainer node lost after step {seen['killed_after_step']} (checkpoint at step {seen['checkpoint_step']}); "
          f"{seen['trained_after_checkpoint']} prompts rewound; restarted on the spare node in "
          f"{seen['restart_s']:.1f} s; scenario {seen['scenario_s']:.0f} s")


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
        cluster.add_node(num_cpus=1, resources={"maker_node": NUM_MAKERS})
        trainer_node = cluster.add_node(**TRAINER_NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config(REPO / "configs" / "tiny.yaml", [
            f"trainer.total_steps={TOTAL_STEPS}", "trainer.train_batch_size=8", "trainer.mini_batch_size=8",
            "trainer.ppo_epochs=1", "trainer.pull_timeout_s=120", "trainer.node_resource=trainer_node",
            "trainer.checkpoint_every=2", "trainer.max_failures=1",
            f"maker.num_makers={NUM_MAKERS}", "maker.batch_size=4", "maker.node_resource=maker_node",
            "logging.report_every=1", f"logging.output_dir={run_dir}"])
        trainer = PPOTrainer(cfg)
        seen = {"train_batch_size": cfg.trainer.train_batch_size, "error": None}
        fit = threading.Thread(target=fit_recording_error, args=(trainer, seen), daemon=True)
        fit.start()  # Cluster.add_node/remove_node only work from the main thread
        save = lambda: Path(out_path).write_text(json.dumps({**seen, "history": trainer.history}, default=str))  # noqa: E731
        wait_for(lambda: len(trainer.history) >= 1, SCENARIO_TIMEOUT_S)
        save()
        rank_nodes = [_node_of(coordinator_status(trainer)["rank_pids"][0])]
        spare = cluster.add_node(**TRAINER_NODE)
        checkpoint = Path(run_dir) / "checkpoint" / "state.json"
        wait_for(lambda: checkpoint.exists() and trainer.history[-1]["step"] > json.loads(checkpoint.read_text())["step"], SCENARIO_TIMEOUT_S)
        saved = json.loads(checkpoint.read_text())
        status = coordinator_status(trainer)
        seen.update(checkpoint_step=saved["step"], killed_after_step=trainer.history[-1]["step"],
                    trained_after_checkpoint=status["counters"]["prompts_trained"] - len(
                        [p for _, ids in saved["data"]["trained"] for p in ids]))
        save()
        killed_at = time.monotonic()
        cluster.remove_node(trainer_node, allow_graceful=False)
        old_pid = status["rank_pids"][0]
        wait_for(lambda: coordinator_status(trainer).get("rank_pids", {}).get(0) not in (None, old_pid), SCENARIO_TIMEOUT_S)
        seen["restart_s"] = time.monotonic() - killed_at
        save()
        rank_nodes.append(_node_of(coordinator_status(trainer)["rank_pids"][0]))
        record_end_of_fit(trainer, seen, fit, start, SCENARIO_TIMEOUT_S)
        seen.update(rank_nodes=rank_nodes,
                    nodes={"trainer": trainer_node.node_id, "spare": spare.node_id},
                    final_checkpoint=json.loads(checkpoint.read_text()), scenario_s=time.monotonic() - start)
        Path(out_path).write_text(json.dumps(seen, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of(pid: int) -> str | None:
    """The node whose worker process has ``pid`` (the GCS's record of live actors and their pids)."""
    import ray._private.state

    for actor in ray._private.state.actors().values():
        if actor.get("Pid") == pid and actor["State"] == "ALIVE":
            return actor["Address"]["NodeID"]
    return None


if __name__ == "__main__":
    run_scenario(sys.argv[1], sys.argv[2])

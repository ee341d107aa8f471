"""What a run reserves from the cluster, checked against what the cluster has before any actor starts.

    plan = ResourcePlan.of(cfg)              # makers, trainer workers, the prompt reader
    print(plan.line(cluster))                # "resources: 2 makers x 0.5 CPU + ... = 2.25 CPUs of the cluster's 8"
    check_fits(plan, cluster, can_grow=False)  # ResourceError: one line with both numbers and the fix

A run whose reservations exceed the cluster does not fail by itself: the part that cannot be
placed waits. When that part is the task that reads the prompts, every maker waits on the
coordinator and the trainer's first pull times out minutes later, naming neither. Hence the
check. A cluster that an autoscaler can grow is not refused: what does not fit now stays
pending until nodes are added (``can_grow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ray_ppo.config import Config, ConfigError, TrainerConfig

READ_CPUS = 0.25
"""CPUs of each read task of a prompt file or the toy prompts (``ray_ppo.cluster.datasets.read_prompt_dataset``)."""
GIVEN_DATASET_READ_CPUS = 1.0
"""CPUs Ray Data asks for a read task of a dataset given to ``PPOTrainer`` (its default)."""


class ResourceError(ConfigError):
    """The run reserves more than the cluster has: one line with both numbers and the fix."""


@dataclass(frozen=True)
class ResourcePlan:
    """CPUs and GPUs one run (or ``trials`` runs side by side) reserves."""

    makers: int
    maker_cpus: float
    maker_gpus: float
    workers: int
    worker_cpus: float
    worker_gpus: float
    reader_cpus: float
    trials: int = 1
    trial_cpus: float = 0.0
    """CPUs of each trial's own process (a Tune trial's driver)."""

    @classmethod
    def of(cls, cfg: Config, given_dataset: bool = False, trials: int = 1, trial_cpus: float = 0.0) -> ResourcePlan:
        m, t = cfg.maker, cfg.trainer
        return cls(makers=m.num_makers, maker_cpus=m.num_cpus, maker_gpus=m.num_gpus, workers=t.num_workers,
                   worker_cpus=t.cpus_per_worker, worker_gpus=t.gpus_per_worker if t.use_gpu else 0.0,
                   reader_cpus=GIVEN_DATASET_READ_CPUS if given_dataset else READ_CPUS,
                   trials=trials, trial_cpus=trial_cpus)

    @property
    def run_cpus(self) -> float:
        """CPUs of one run: its makers, trainer workers, prompt reader and (in a sweep) trial process."""
        return (self.makers * self.maker_cpus + self.workers * self.worker_cpus + self.reader_cpus
                + self.trial_cpus)

    @property
    def cpus(self) -> float:
        return self.trials * self.run_cpus

    @property
    def gpus(self) -> float:
        return self.trials * (self.makers * self.maker_gpus + self.workers * self.worker_gpus)

    def parts(self) -> str:
        """``2 makers x 0.5 CPU + 1 trainer worker x 1 CPU + prompt reader 0.25 CPU``."""
        parts = [f"{_n(self.makers, 'maker')} x {self.maker_cpus:g} CPU",
                 f"{_n(self.workers, 'trainer worker')} x {self.worker_cpus:g} CPU",
                 f"prompt reader {self.reader_cpus:g} CPU"]
        if self.trial_cpus:
            parts.append(f"trial process {self.trial_cpus:g} CPU")
        one = " + ".join(parts)
        return f"{self.trials} trials x ({one})" if self.trials > 1 else one

    def line(self, cluster: Mapping[str, float]) -> str:
        """One line for the start of a run: what it reserves against what the cluster has."""
        gpus = f", {self.gpus:g} of {cluster.get('GPU', 0):g} GPUs" if self.gpus else ""
        return (f"resources: {self.parts()} = {self.cpus:g} CPUs of the cluster's {cluster.get('CPU', 0):g}"
                f"{gpus}")


def worker_resources(t: TrainerConfig) -> dict[str, float]:
    """What each training worker reserves (Ray Train's ``resources_per_worker``): its CPUs, its share
    of a GPU with ``use_gpu`` (a fraction lets makers share that GPU) and one unit of ``node_resource``."""
    return {"CPU": t.cpus_per_worker, **({"GPU": t.gpus_per_worker} if t.use_gpu else {}),
            **({t.node_resource: 1} if t.node_resource else {})}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def check_fits(plan: ResourcePlan, cluster: Mapping[str, float], can_grow: bool = False, where: str = "the cluster") -> None:
    """Raise ``ResourceError`` if ``plan`` needs more CPUs or GPUs than ``cluster`` has, unless
    the cluster ``can_grow`` (an autoscaler adds nodes for what is pending)."""
    if can_grow:
        return
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    if plan.cpus > cpus + 1e-9:
        raise ResourceError(
            f"the run reserves {plan.cpus:g} CPUs ({plan.parts()}) but {where} has {cpus:g}, so part of it would wait "
            f"forever; use fewer makers (maker.num_makers) or fewer CPUs each (maker.num_cpus, "
            f"trainer.cpus_per_worker), or give the cluster more logical CPUs (ray.init(num_cpus=8), "
            f"ray-ppo train --num-cpus 8: more logical CPUs than cores is fine for small models)")
    if plan.gpus > gpus + 1e-9:
        raise ResourceError(
            f"the run reserves {plan.gpus:g} GPUs (maker.num_gpus={plan.maker_gpus:g} x {plan.makers} makers, "
            f"{plan.worker_gpus:g} x {plan.workers} trainer workers{' per trial' if plan.trials > 1 else ''}) "
            f"but {where} has {gpus:g}; lower maker.num_gpus, trainer.num_workers, trainer.gpus_per_worker or set "
            f"trainer.use_gpu=false")


def cluster_can_grow() -> bool:
    """Whether the connected cluster may gain nodes: any cluster this process did not start itself.

    A local cluster started by ``ray.init()`` (or the CLI) has exactly the resources it started
    with; one attached to (``--address``, ``ray.init(address=...)``, a Tune trial's process) may
    have an autoscaler, so its shortfall is left pending. Read from the driver's node, which Ray
    exposes no public call for (``ray_ppo.cluster.ray_private.driver_node``)."""
    from ray_ppo.cluster.ray_private import driver_node

    node = driver_node()
    return node is None or not node.head

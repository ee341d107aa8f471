"""Run checkpoints: what they hold, writing them atomically, reading them safely.

A checkpoint directory holds:

    actor/, critic/          save_pretrained (safetensors) for users; tokenizer beside the actor
    trainer/actor.safetensors, trainer/critic.safetensors
                             the trainer's exact state dicts (LoRA adapters included) for resuming
                             (no critic/ and no critic.safetensors for the critic-free estimators)
    trainer/optimizer.pt     optimizer, scheduler and RNG state (plain tensors; loaded weights_only)
    state.json               step, policy version, KL controller, prompt-stream position (``RunState``)

Rank 0 of the train loop writes one with ``CheckpointWriter`` into a temporary directory, reports
it to Ray Train (which copies it to the run's storage) and removes the temporary directory; the
driver publishes Ray Train's copy into the run directory (``publish_checkpoint``). No Ray import here.

Nothing is ever unpickled: weights are safetensors and ``optimizer.pt`` is read with
``torch.load(weights_only=True)``. A missing, truncated or corrupt file raises
``CheckpointError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ray_ppo.config import Config
from ray_ppo.models import load_tokenizer
from ray_ppo.models.build import build_actor, build_critic_if_needed, tokenizer_path
from ray_ppo.models.sync import split_state

FORMAT_VERSION = 1
STATE_FILE = "state.json"
TRAINER_DIR = "trainer"
REQUIRED = (STATE_FILE, f"{TRAINER_DIR}/actor.safetensors", f"{TRAINER_DIR}/optimizer.pt")
CRITIC_FILE = f"{TRAINER_DIR}/critic.safetensors"
"""Present when the run trains a critic (``algo.advantage=gae``)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the file and the reason."""


@dataclass(frozen=True)
class RunState:
    """Where the run stands at a checkpoint, besides weights and optimizer: ``state.json``."""

    step: int
    """The step the checkpoint was written at; a resumed run starts at the next one."""
    policy_version: int
    """The policy version of the checkpoint's weights (one up from the step's when it pushed)."""
    kl_ctl: dict = field(default_factory=dict)
    """The KL controller's ``state_dict`` (``ray_ppo.algo.make_kl_controller``)."""
    data: dict | None = None
    """Where the prompt stream continues (``PromptLedger.state`` at ``step``, with ``first_prompt``)."""
    has_critic: bool = True
    """Whether the checkpoint holds a critic (``CRITIC_FILE``); False for the critic-free estimators."""

    def to_dict(self) -> dict[str, Any]:
        """``state.json``'s content, its keys in the file's order."""
        return {"format": FORMAT_VERSION, "has_critic": self.has_critic, "step": self.step,
                "policy_version": self.policy_version, "kl_ctl": self.kl_ctl, "data": self.data}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RunState:
        """The run state of a ``state.json`` (its ``format`` checked by ``read_state``)."""
        return cls(step=int(state["step"]), policy_version=int(state["policy_version"]),
                   kl_ctl=state.get("kl_ctl", {}), data=state.get("data"), has_critic=bool(state.get("has_critic", True)))


def save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, str(path))


def write_trainer_state(directory: Path, actor: dict, critic: dict | None, optimizer: dict, run_state: RunState) -> None:
    """The resumable part of a checkpoint (``trainer/`` and ``state.json``) into ``directory``;
    ``critic`` None for a critic-free run (``state.json`` says whether it has one)."""
    (directory / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
    save_tensors(actor, directory / TRAINER_DIR / "actor.safetensors")
    if critic is not None:
        save_tensors(critic, directory / CRITIC_FILE)
    torch.save(optimizer, directory / TRAINER_DIR / "optimizer.pt")
    run_state = dataclasses.replace(run_state, has_critic=critic is not None)
    (directory / STATE_FILE).write_text(json.dumps(run_state.to_dict(), indent=2))


def read_state(directory: str | Path) -> RunState:
    """``state.json`` of a checkpoint, after checking every required file is there (the critic's
    too, unless ``state.json`` says the run had none)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    missing = [name for name in REQUIRED if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {directory / STATE_FILE} is corrupt: {e}") from None
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format {state.get('format')!r}; this ray_ppo reads {FORMAT_VERSION}")
    try:
        run_state = RunState.from_dict(state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {directory / STATE_FILE} is corrupt: {type(e).__name__}: {e}") from None
    if run_state.has_critic and not (directory / CRITIC_FILE).is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: missing {CRITIC_FILE}")
    return run_state


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for truncated or garbled files
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {type(e).__name__}: {e}") from None


def validate_checkpoint(directory: str | Path) -> RunState:
    """Check a checkpoint without loading its weights (safetensors headers and sizes, the
    optimizer file); returns its run state. Raises ``CheckpointError`` naming the bad file."""
    from safetensors import safe_open

    directory = Path(directory)
    run_state = read_state(directory)
    for name in ("actor", "critic"):
        path = directory / TRAINER_DIR / f"{name}.safetensors"
        if name == "critic" and not run_state.has_critic:
            continue  # a critic-free run's checkpoint
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:
            raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {type(e).__name__}: {e}") from None
    _load_optimizer(directory)
    return run_state


def _load_optimizer(directory: Path) -> dict:
    path = directory / TRAINER_DIR / "optimizer.pt"
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {type(e).__name__}: {e}") from None


class TrainerState(NamedTuple):
    """What a checkpoint holds for the trainer (``load_trainer_state``)."""

    actor: dict
    """The actor's state dict."""
    critic: dict | None
    """The critic's state dict; None in a critic-free run's checkpoint."""
    optimizer: dict
    run: RunState
    """The run state: step, policy version, KL controller, data position."""


def load_trainer_state(directory: str | Path) -> TrainerState:
    """A checkpoint's trainer state, validated."""
    directory = Path(directory)
    run_state = read_state(directory)
    actor = load_tensors(directory / TRAINER_DIR / "actor.safetensors")
    critic = load_tensors(directory / CRITIC_FILE) if run_state.has_critic else None
    return TrainerState(actor, critic, _load_optimizer(directory), run_state)


class CheckpointWriter:
    """Rank 0 writes actor and critic (``save_pretrained``, safetensors; no critic for the
    critic-free estimators), tokenizer, optimizer state and run state into a fresh temporary
    directory that the train loop reports as a ``ray.train.Checkpoint`` and then removes."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._actor = self._critic = None  # CPU copies that receive full state dicts before saving

    def write(self, state: dict[str, torch.Tensor], optim_state: dict, run_state: RunState) -> Path:
        if self._actor is None:
            self._actor, self._critic = build_actor(self.cfg), build_critic_if_needed(self.cfg)
        actor_state, critic_state = split_state(state)
        self._actor.load_state_dict(actor_state)
        directory = Path(tempfile.mkdtemp(prefix="ray_ppo_ckpt_"))
        try:
            self._actor.save_pretrained(directory / "actor")
            load_tokenizer(tokenizer_path(self.cfg)).save_pretrained(directory / "actor")
            if self._critic is not None:
                self._critic.load_state_dict(critic_state)
                self._critic.save_pretrained(directory / "critic")
            write_trainer_state(directory, actor_state, critic_state if self._critic is not None else None,
                                optim_state, run_state)
        except OSError as e:  # a full disk: no partial checkpoint is left, the previous one is intact
            shutil.rmtree(directory, ignore_errors=True)
            raise OSError(e.errno, f"the checkpoint of step {run_state.step} could not be written ({e}); "
                                   f"RUN_DIR/checkpoint still holds the previous one: free space, then "
                                   f"ray-ppo train --resume RUN_DIR") from None
        return directory


def restore_point(checkpoint: Any, resume_from: str | None) -> TrainerState | None:
    """The state to resume from, validated: ``checkpoint`` (this run's latest ``ray.train.Checkpoint``,
    when Ray Train restarted the worker group under ``FailureConfig``) if given, else the
    ``resume_from`` directory; None for a fresh run."""
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            return load_trainer_state(directory)
    return load_trainer_state(resume_from) if resume_from else None


def restored_critic(state: dict | None, cfg: Config) -> dict:
    """The checkpoint's critic weights; a clear error if it has none (a critic-free run's checkpoint)."""
    if state is None:
        raise ValueError(f"algo.advantage={cfg.algo.advantage} trains a critic, but the checkpoint has none "
                         f"(it was made by a critic-free estimator); resume with that run's algo.advantage")
    return state


KEEP_CHECKPOINTS = 2
"""Complete checkpoints kept in ``RUN_DIR/checkpoints/`` by default (``trainer.keep_checkpoints``);
the newest is ``RUN_DIR/checkpoint``."""
STORE = "checkpoints"
LINK = "checkpoint"


def publish_checkpoint(source: str | Path, run_dir: str | Path, step: int, keep: int = KEEP_CHECKPOINTS) -> Path:
    """Put a checkpoint into ``run_dir/checkpoints/step_<N>`` and point ``run_dir/checkpoint`` at it.

    Files are hard-linked where the file system allows (Ray Train's copy under
    ``run_dir/ray_train`` and this one then share their bytes), else copied. The copy goes to a
    temporary directory that is renamed when complete, and the link is swapped with one atomic
    ``os.replace``: a crash, a full disk or Ctrl-C at any moment leaves ``run_dir/checkpoint`` on
    the previous complete checkpoint or on the new one, never on a partial copy. A write that
    fails (``OSError``, e.g. ``ENOSPC``) removes its partial copy and re-raises. Then all but
    the ``keep`` newest checkpoints up to this one are removed. Publishing the same step twice
    is a no-op.
    """
    run_dir = Path(run_dir)
    store = run_dir / STORE
    store.mkdir(parents=True, exist_ok=True)
    final = store / f"step_{step:08d}"
    if not final.exists():
        staging = store / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(source, staging, copy_function=_link_or_copy)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _point_at(run_dir, final)
    for stale in sorted(p for p in store.glob("step_*") if p.name < final.name)[:-(keep - 1) or None]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def size_line(directory: str | Path, run_dir: str | Path, step: int, keep: int) -> str:
    """``checkpoint of step 2: 2.2 GB in RUN_DIR/checkpoints, up to 2 kept (trainer.keep_checkpoints=2)``:
    the size of the published checkpoint ``directory``, which the driver prints once, for a run's
    first. A checkpoint holds the weights twice (``actor/`` and ``critic/`` for users, ``trainer/``
    for resuming) and the optimizer's two Adam moments: about four times the float32 weights."""
    size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    return (f"checkpoint of step {step}: {_human(size)} in {Path(run_dir) / STORE}, up to {keep} kept "
            f"(trainer.keep_checkpoints={keep})")


def _human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        shutil.copy2(src, dst)


def _point_at(run_dir: Path, final: Path) -> None:
    """Swap ``run_dir/checkpoint`` to ``final`` atomically (a relative symlink)."""
    link, tmp_link = run_dir / LINK, run_dir / f".checkpoint-{uuid.uuid4().hex[:8]}"
    os.symlink(Path(STORE) / final.name, tmp_link)
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp_link, link)


def linked_step(run_dir: str | Path) -> int | None:
    """The step ``run_dir/checkpoint`` holds, or None if there is none."""
    try:
        return read_state(Path(run_dir) / LINK).step
    except CheckpointError:
        return None

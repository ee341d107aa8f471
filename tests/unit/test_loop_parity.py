"""The synchronous loop (``ray_ppo.local``) and the detached one (``ray_ppo.train.loop``) give a
config key they both read the same meaning, and the synchronous loop refuses what it cannot do.

Every config key the detached loop reads is in one of three lists: ``SHARED`` (honoured by both;
one case per key runs the synchronous loop on the tiny model and asserts the key's effect),
``REFUSED`` (the synchronous loop raises a one-line ``ConfigError``) or ``DETACHED_ONLY`` (the
machinery of makers, pushes and ranks, with no meaning in one process). A scan of both modules'
source finds the keys they read, so a key newly read by the detached loop fails here until it is
listed. The scan sees the loops' own reads (``cfg.<section>.<field>``, names bound to a section,
the methods and properties of ``INDIRECT``); what the learner and the maker read is the same
code in both loops.
"""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from pydantic import BaseModel

from ray_ppo import local
from ray_ppo.config import Config, ConfigError
from ray_ppo.config.preflight import check_local_loop
from ray_ppo.outputs.evals import split_evals
from ray_ppo.outputs.samples import SAMPLES_KEY

ROOT = Path(__file__).parents[2]
LOCAL = (ROOT / "ray_ppo" / "local.py").read_text() + "\n" + inspect.getsource(check_local_loop)
"""The synchronous loop's source, with the pre-flight check of what it refuses."""
DETACHED = (ROOT / "ray_ppo" / "train" / "loop.py").read_text()
PROMPTS = str(ROOT / "data" / "toy_prompts.csv")
SMALL = {"trainer.total_steps": 2, "trainer.train_batch_size": 8, "trainer.mini_batch_size": 4,
         "maker.batch_size": 8, "maker.max_new_tokens": 4}

SHARED: dict[str, Callable[[Any], None]] = {}
"""key -> a check that runs the synchronous loop (``run``: overrides -> rows) and asserts the key's effect."""

REFUSED = {"maker.engine": "vllm", "maker.dtype": "bfloat16", "trainer.use_gpu": True, "trainer.num_workers": 2,
           "trainer.update_steps": 2, "trainer.checkpoint_every": 5}
"""key -> a value the synchronous loop refuses."""

THROUGH_THE_LEARNER = {"trainer.max_grad_norm"}
"""Shared keys the synchronous loop's own source does not read: ``PPOLearner`` honours them in both loops."""

DETACHED_ONLY = {
    "trainer.prefetch", "trainer.pull_timeout_s",  # pulls from the coordinator
    "trainer.strategy",  # how ranks share the model; one process wraps nothing
    "sync.bucket_mb", "sync.lora_only", "maker.wait_for_weights",  # pushes to makers
    "maker.vllm.dtype",  # a vLLM engine's (maker.engine=vllm is refused)
    "logging.report_every",  # ray.train.report calls; every step's row is written in both loops
}

INDIRECT = {"eval.due": {"eval.path", "eval.every"}, "ppo.uses_reference": {"ppo.kl_coef", "ppo.kl_target"},
            "maker_dtype": {"maker.dtype", "model.dtype"},
            "engine_dtype": {"maker.engine", "maker.vllm.dtype", "maker.dtype", "model.dtype"}}
"""The keys a method or property of the config reads."""


def shared(key: str):
    """Register the decorated check as ``key``'s effect in ``SHARED``."""
    def register(check: Callable[[Any], None]) -> Callable[[Any], None]:
        SHARED[key] = check
        return check
    return register


# -- the effect of each shared key ----------------------------------------------------------------


@shared("trainer.total_steps")
def _(run):
    assert [row["step"] for row in run({"trainer.total_steps": 3})] == [1, 2, 3]


@shared("trainer.time_budget_s")
def _(run):
    # The first step ends past a 1 us budget: it is the last, and evaluates as a last step does.
    rows = run({"trainer.time_budget_s": 1e-6, "trainer.total_steps": 50, "eval.path": PROMPTS, "eval.every": 10,
                "eval.num_prompts": 4})
    assert [row["step"] for row in rows] == [1]
    assert [report["step"] for report in split_evals(rows[0])[1]] == [0, 1]


@shared("trainer.train_batch_size")
def _(run):
    sizes = []
    run({"trainer.train_batch_size": 16}, on_step=lambda learner, batch: sizes.append(batch.batch_size))
    assert sizes == [16, 16]


@shared("trainer.torch_threads")
def _(run):
    try:
        run({"trainer.total_steps": 1, "trainer.torch_threads": 2})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


@shared("trainer.max_grad_norm")
def _(run):
    # At lr 1e-2 the first minibatch's update moves the policy (approx_kl > 0 at the later ones);
    # clipped to a norm of 1e-12 it does not.
    fast = {"trainer.total_steps": 1, "trainer.actor_lr": 1e-2, "trainer.critic_lr": 1e-2, "trainer.ppo_epochs": 2}
    assert run({**fast, "trainer.max_grad_norm": 0.0})[0]["approx_kl"] > 1e-3
    assert abs(run({**fast, "trainer.max_grad_norm": 1e-12})[0]["approx_kl"]) < 1e-6


@shared("seed")
def _(run):
    def losses(seed):
        return [(row["policy_loss"], row["entropy"]) for row in run({"seed": seed})]
    assert losses(0) == losses(0) != losses(1)


@shared("logging.samples_every")
def _(run):
    rows = run({"trainer.total_steps": 3, "logging.samples_every": 2})
    assert [SAMPLES_KEY in row for row in rows] == [False, True, False]
    assert not any(SAMPLES_KEY in row for row in run({"logging.samples_every": 0}))


@shared("eval.path")
def _(run):
    rows = run({"eval.path": PROMPTS, "eval.num_prompts": 4})
    assert [report["step"] for row in rows for report in split_evals(row)[1]] == [0, 2]  # the base model, the last
    assert not any(split_evals(row)[1] for row in run({}))


@shared("eval.every")
def _(run):
    rows = run({"trainer.total_steps": 3, "eval.path": PROMPTS, "eval.num_prompts": 4, "eval.every": 2})
    assert [report["step"] for row in rows for report in split_evals(row)[1]] == [0, 2, 3]


@shared("ppo.kl_coef")
def _(run):
    assert {row["kl_coef"] for row in run({"ppo.kl_coef": 0.3})} == {0.3}
    assert not any("kl" in row for row in run({"ppo.kl_coef": 0.0}))  # no reference: no KL


@shared("ppo.kl_target")
def _(run):
    # The adaptive controller moves the coefficient after each step; without a target it stays.
    assert run({"ppo.kl_target": 6.0, "ppo.kl_horizon": 100})[0]["kl_coef"] != 0.05
    assert {row["kl_coef"] for row in run({})} == {0.05}


@shared("ppo.kl_horizon")
def _(run):
    def change(horizon):
        return abs(run({"trainer.total_steps": 1, "ppo.kl_target": 6.0, "ppo.kl_horizon": horizon})[0]["kl_coef"] - 0.05)
    assert change(100) > change(10000) > 0


@shared("maker.max_running")
def _(run):
    from ray_ppo.models import continuous

    running, step = [], continuous.ContinuousBatcher.step

    def spy(self, *args, **kwargs):
        done = step(self, *args, **kwargs)
        running.append(len(self.rows) + len(done))
        return done

    continuous.ContinuousBatcher.step = spy
    try:
        batches = []
        run({"maker.max_running": 3}, on_step=lambda learner, batch: batches.append(batch))
        streamed, trained = len(running), [len(batch.sequences) for batch in batches]
        run({"maker.max_running": 0})
    finally:
        continuous.ContinuousBatcher.step = step
    assert streamed == len(running) and max(running) == 3  # batch by batch with 0: no batcher step
    assert trained == [8, 8]  # whole steps of train_batch_size, as batch by batch
    episodes = run({"maker.max_running": 3, "env.cls": "ray_ppo.tasks.turns:TwoTurnEnv", "env.max_tokens": 16})
    assert all(1 <= row["env/turns"] <= 2 for row in episodes) and any(row["env/turns"] > 1 for row in episodes)


@shared("algo.dynamic_sampling")
def _(run):
    batches = []
    rows = run({"algo.dynamic_sampling": True, "algo.dynamic_sampling_max_draws": 1000, "algo.advantage": "grpo",
                "maker.samples_per_prompt": 2, "maker.max_new_tokens": 2},
               on_step=lambda learner, batch: batches.append(batch.reward.view(-1, 2)))
    assert all(bool((groups[:, 0] != groups[:, 1]).all()) for groups in batches)  # no uniform group is trained
    assert [len(groups) for groups in batches] == [4, 4]
    assert rows[-1]["prompts_dropped"] > 0 and 0 < rows[-1]["groups_dropped_share"] < 1


@shared("model.dtype")
def _(run):
    # The learner's weights, which the maker generates with, are in model.dtype (a maker.dtype equal to it is accepted).
    dtypes = []
    run({"trainer.total_steps": 1, "model.dtype": "bfloat16", "maker.dtype": "bfloat16"},
        on_step=lambda learner, batch: dtypes.append(next(learner.actor.parameters()).dtype))
    assert dtypes == [torch.bfloat16]


@pytest.fixture
def run(monkeypatch):
    """The synchronous loop on the tiny model with ``SMALL`` and the given overrides; its rows as
    ``on_metrics`` sees them. ``on_step(learner, batch)`` sees each batch the learner trains on."""
    learner_class = local.PPOLearner

    def run_with(overrides: dict, on_step: Callable | None = None) -> list[dict]:
        if on_step is not None:
            class Learner(learner_class):
                def train_step(self, batch, **kwargs):
                    on_step(self, batch)
                    return super().train_step(batch, **kwargs)
            monkeypatch.setattr(local, "PPOLearner", Learner)
        rows = []
        local.run_local(Config().with_overrides({**SMALL, **overrides}), on_metrics=rows.append)
        return rows
    return run_with


@pytest.mark.parametrize("key", sorted(SHARED))
def test_a_shared_key_has_its_effect_in_the_synchronous_loop(key, run):
    SHARED[key](run)


def test_the_time_budget_counts_from_the_first_step(run, monkeypatch):
    """Start-up (models, prompts, the base model's evaluation) is not counted, as in the detached
    loop, whose clock starts once its makers have the weights to start from."""
    evaluated, clocks = [], []
    evaluate, time_up = local._evaluate, local.broadcast_time_up

    def timed_evaluate(*args):
        report = evaluate(*args)
        evaluated.append(time.perf_counter())
        return report

    def timed_up(budget_s, run_start, device):
        clocks.append(run_start)
        return time_up(budget_s, run_start, device)

    monkeypatch.setattr(local, "_evaluate", timed_evaluate)
    monkeypatch.setattr(local, "broadcast_time_up", timed_up)
    run({"trainer.time_budget_s": 3600, "eval.path": PROMPTS, "eval.num_prompts": 4})
    assert len(set(clocks)) == 1 and clocks[0] >= evaluated[0]  # after the base model's evaluation


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_the_synchronous_loop_refuses_in_one_line_what_it_cannot_honour(key, monkeypatch):
    monkeypatch.setattr("ray_ppo.config.schema.check_engine_available", lambda engine: None)  # vLLM need not be installed
    cfg = Config().with_overrides({**SMALL, key: REFUSED[key]})
    with pytest.raises(ConfigError) as refused:
        local.run_local(cfg)
    assert f"{key}=" in str(refused.value) and "\n" not in str(refused.value)


# -- the lists cover what the loops read ----------------------------------------------------------


def test_every_key_both_loops_read_is_shared_or_refused():
    assert config_reads(LOCAL) & config_reads(DETACHED) - set(SHARED) - set(REFUSED) == set()


def test_every_key_the_detached_loop_reads_is_listed():
    assert config_reads(DETACHED) - set(SHARED) - set(REFUSED) - DETACHED_ONLY == set()


def test_a_shared_key_is_read_by_the_synchronous_loop_or_its_learner():
    assert set(SHARED) - config_reads(LOCAL) == THROUGH_THE_LEARNER
    learner = (ROOT / "ray_ppo" / "train" / "learner.py").read_text()
    assert all(f"self.{key}" in learner for key in THROUGH_THE_LEARNER)


def test_the_lists_name_config_keys_once():
    lists = [set(SHARED), set(REFUSED), DETACHED_ONLY]
    assert sum(map(len, lists)) == len(set().union(*lists))
    for key in set().union(*lists):
        Config().get(key)  # raises for a key the config does not have
    assert {"trainer.time_budget_s", "trainer.total_steps", "eval.every"} <= config_reads(LOCAL) & config_reads(DETACHED)


def config_reads(source: str) -> set[str]:
    """The config keys a source reads: attribute chains through ``cfg`` (``run.cfg`` too)
    or through a name bound to a section (``t = run.cfg.trainer``, ``t: TrainerConfig``), down to
    a field, or to a method or property of ``INDIRECT``. A chain that reaches neither fails."""
    tree = ast.parse(source)
    aliases = _section_aliases(tree)
    keys = set()
    for node in ast.walk(tree):
        parts = _chain(node) if isinstance(node, ast.Attribute) else []
        if "cfg" in parts:
            keys |= _keys(parts[parts.index("cfg") + 1:])
        elif parts and parts[0] in aliases:
            keys |= _keys(aliases[parts[0]] + parts[1:])
    return keys


def _chain(node: ast.expr) -> list[str]:
    """``a.b.c`` as ``["a", "b", "c"]``; [] for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _chain(node.value)
        return head + [node.attr] if head else []
    return []


def _names_a_section(parts: list[str]) -> bool:
    """Whether ``cfg.<parts>`` is a config section."""
    model: type[BaseModel] = Config
    for name in parts:
        field = model.model_fields.get(name)
        if field is None or not _is_section(field.annotation):
            return False
        model = field.annotation
    return True


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_aliases(tree: ast.Module) -> dict[str, list[str]]:
    """Names bound to a config section: ``t = run.cfg.trainer`` (in a tuple assignment too) and
    parameters annotated with a section's class (``t: TrainerConfig``)."""
    classes = {field.annotation.__name__: [name] for name, field in Config.model_fields.items()
               if _is_section(field.annotation)}
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and isinstance(node.annotation, ast.Name) and node.annotation.id in classes:
            aliases[node.arg] = classes[node.annotation.id]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                else [(target, value)]
            for name, bound in pairs:
                parts = _chain(bound)
                if isinstance(name, ast.Name) and "cfg" in parts:
                    path = parts[parts.index("cfg") + 1:]
                    if path and _names_a_section(path):
                        aliases[name.id] = path
    return aliases


def _keys(parts: list[str]) -> set[str]:
    """The keys that reading ``cfg.<parts>`` reads: one field, the keys of an ``INDIRECT`` method
    or property, or none for a section itself."""
    model: type[BaseModel] = Config
    for i, name in enumerate(parts):
        dotted = ".".join(parts[:i + 1])
        if dotted in INDIRECT:
            return INDIRECT[dotted]
        field = model.model_fields.get(name)
        assert field is not None, f"cfg.{dotted} is neither a config key nor in INDIRECT: add the keys it reads"
        if not _is_section(field.annotation):
            return {dotted}
        model = field.annotation
    return set()

"""ColossalAIStrategy's Booster path on CPU, in one gloo process (world size 1).

``ColossalAIStrategy.torch_ddp_on_cpu`` (TorchDDPPlugin, torch AdamW) runs the PPO learner through
the Booster: boost, backward, clip, step, full state dicts for a push, optimizer state and booster
checkpoints. ZeRO-2 (LowLevelZeroPlugin) asserts a CUDA accelerator; the last tests run its real
optimizer on CPU behind a stand-in accelerator that reports itself as "cuda" and has no streams.
Neither HybridAdam (its kernels are CUDA extensions) nor Gemini runs here.

Run by ``make test-colossalai`` in the environment with colossalai's pins.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket

import pytest
import torch

pytest.importorskip("colossalai", reason="colossalai is not installed: run make test-colossalai")

import torch.distributed as dist  # noqa: E402
from colossalai.accelerator import CpuAccelerator, set_accelerator  # noqa: E402
from colossalai.booster.plugin import LowLevelZeroPlugin  # noqa: E402
from colossalai.booster.plugin.torch_ddp_plugin import TorchDDPModel  # noqa: E402
from colossalai.zero import LowLevelZeroOptimizer  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402

from ray_ppo.algo import ExperienceBatch  # noqa: E402
from ray_ppo.config import Config  # noqa: E402
from ray_ppo.makers.experience import ExperienceMaker  # noqa: E402
from ray_ppo.models import Critic, load_tokenizer  # noqa: E402
from ray_ppo.models.hf import disable_dropout  # noqa: E402
from ray_ppo.models.lora import apply_lora, trainable_names  # noqa: E402
from ray_ppo.models.tiny import build_tiny_model  # noqa: E402
from ray_ppo.tasks import toy  # noqa: E402
from ray_ppo.train.colossalai_strategy import ColossalAIStrategy, Recipe  # noqa: E402
from ray_ppo.train.learner import PPOLearner  # noqa: E402

pytestmark = pytest.mark.colossalai


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """A single-process gloo group, as Ray Train would have set up on each worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def load_models(path: str) -> tuple[torch.nn.Module, Critic]:
    """Actor and critic as the pipelines build them (dropout off), loaded with transformers' own
    ``from_pretrained`` defaults."""
    return (disable_dropout(AutoModelForCausalLM.from_pretrained(path)),
            disable_dropout(Critic(AutoModel.from_pretrained(path))))


@pytest.fixture(scope="module")
def experience(model_path) -> ExperienceBatch:
    """One merged batch of 8 toy-task samples from the tiny model."""
    tokenizer = load_tokenizer(model_path)
    actor, critic = load_models(model_path)
    maker = ExperienceMaker(actor, AutoModelForCausalLM.from_pretrained(model_path), critic, tokenizer,
                            Config().with_overrides({"maker.max_new_tokens": 6, "ppo.kl_coef": 0.01}), reward_fn=toy.reward)
    torch.manual_seed(0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in toy.make_prompts(8, 4)]
    items, _ = maker.make_experience(prompts, policy_version=0)
    return ExperienceBatch.merge(items, tokenizer.pad_token_id)


PARAMS = Config().with_overrides({"trainer.actor_lr": 1e-3, "trainer.critic_lr": 1e-3, "trainer.train_batch_size": 8,
                                  "trainer.mini_batch_size": 4, "trainer.ppo_epochs": 2, "trainer.total_steps": 1})
"""The learner's settings for the 8-item batch: 4 updates a step, a schedule of 4 updates."""


def ddp_learner(model_path: str) -> PPOLearner:
    return PPOLearner(*load_models(model_path), ColossalAIStrategy.torch_ddp_on_cpu(), PARAMS, seed=0)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def optimizer_tensors(state: dict) -> dict:
    """``{(param index, name): tensor}`` of a packed optimizer state dict."""
    return {(i, k): v for i, s in state["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


# -- TorchDDPPlugin: the Booster wiring --------------------------------------------------------


def test_the_learner_trains_through_the_booster(model_path, experience):
    params = PARAMS.with_overrides({"trainer.warmup_steps": 8, "trainer.total_steps": 4})  # 16 updates
    ppo = PPOLearner(*load_models(model_path), ColossalAIStrategy.torch_ddp_on_cpu(), params, seed=0)
    assert isinstance(ppo.actor.module, TorchDDPModel) and isinstance(ppo.critic.module, TorchDDPModel)
    before = ppo.strategy.full_state_dict(ppo.actor)
    critic_before = ppo.strategy.full_state_dict(ppo.critic)
    metrics = ppo.train_step(experience)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor_grad_norm"] > 0 and metrics["critic_grad_norm"] > 0
    assert metrics["nonfinite_updates"] == 0
    # 4 updates into an 8-update warm-up: (4 + 1) / 8 of 1e-3, in the groups the boosted optimizer steps with
    assert metrics["actor_lr"] == pytest.approx(6.25e-4)
    assert ppo.actor_optim.boosted.optim.param_groups[0]["lr"] == pytest.approx(6.25e-4)
    after = ppo.strategy.full_state_dict(ppo.actor)
    assert not torch.equal(after["transformer.h.0.attn.c_attn.weight"], before["transformer.h.0.attn.c_attn.weight"])
    critic_after = ppo.strategy.full_state_dict(ppo.critic)
    assert not torch.equal(critic_after["value_head.weight"], critic_before["value_head.weight"])


def test_full_state_dict_is_the_modules_state_dict(model_path, experience):
    ppo = ddp_learner(model_path)
    ppo.train_step(experience)
    for model in (ppo.actor, ppo.critic):
        state = ppo.strategy.full_state_dict(model)
        expected = ppo.strategy.unwrap(model).state_dict()
        assert_same_tensors(state, {k: v.detach() for k, v in expected.items()})
        assert all(v.device.type == "cpu" for v in state.values())
        assert next(iter(state.values())).data_ptr() != next(iter(expected.values())).data_ptr()  # a copy


def test_backward_clip_step_through_the_strategy(model_path, experience):
    strategy = ColossalAIStrategy.torch_ddp_on_cpu(max_grad_norm=0.5)
    actor = strategy.wrap(load_models(model_path)[0])
    optimizer = strategy.make_optimizer(actor, lr=1e-2, weight_decay=0.0)
    out = actor(input_ids=experience.sequences, attention_mask=experience.attention_mask)
    strategy.backward(out.logits.float().pow(2).mean(), actor, optimizer)
    grads = [p.grad for p in strategy.unwrap(actor).parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    with pytest.raises(ValueError, match="max_grad_norm=0.5"):
        strategy.clip_grad_norm(actor, optimizer, 1.0)
    norm = strategy.clip_grad_norm(actor, optimizer, 0.5)
    assert norm == pytest.approx(float(expected), rel=1e-5) and norm > 0.5
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(clipped) == pytest.approx(0.5, rel=1e-4)
    before = {k: v.clone() for k, v in strategy.unwrap(actor).state_dict().items()}
    strategy.step(optimizer, actor)
    assert all(p.grad is None for p in strategy.unwrap(actor).parameters())
    assert not torch.equal(strategy.unwrap(actor).transformer.wte.weight, before["transformer.wte.weight"])


def test_full_optimizer_state_round_trip(model_path, experience):
    ppo = ddp_learner(model_path)
    ppo.train_step(experience)
    state = ppo.strategy.full_optimizer_state_dict(ppo.actor, ppo.actor_optim)
    assert len(state["state"]) == sum(1 for p in ppo.strategy.unwrap(ppo.actor).parameters() if p.requires_grad)
    other = ddp_learner(model_path)
    other.strategy.load_optimizer_state(other.actor, other.actor_optim, state)
    assert_same_tensors(optimizer_tensors(other.strategy.full_optimizer_state_dict(other.actor, other.actor_optim)),
                        optimizer_tensors(state))


def test_booster_checkpoint_round_trip(model_path, experience, tmp_path):
    ppo = ddp_learner(model_path)
    ppo.train_step(experience)
    booster, model, optimizer = ppo.actor.booster, ppo.actor.module, ppo.actor_optim.boosted
    # safetensors refuses GPT-2's tied wte/lm_head tensors, so the shards are torch files
    booster.save_model(model, str(tmp_path / "model"), shard=True)
    # one file: loading sharded optimizer states synchronizes the accelerator, which the CPU one refuses
    booster.save_optimizer(optimizer, str(tmp_path / "optimizer.pt"))

    other = ddp_learner(model_path)
    other.actor.booster.load_model(other.actor.module, str(tmp_path / "model"))
    other.actor.booster.load_optimizer(other.actor_optim.boosted, str(tmp_path / "optimizer.pt"))
    assert_same_tensors(other.strategy.full_state_dict(other.actor), ppo.strategy.full_state_dict(ppo.actor))
    assert_same_tensors(optimizer_tensors(other.actor_optim.boosted.state_dict()),
                        optimizer_tensors(optimizer.state_dict()))
    other.generator.set_state(ppo.generator.get_state())
    ppo.train_step(experience), other.train_step(experience)  # and both go on identically
    assert_same_tensors(other.strategy.full_state_dict(other.actor), ppo.strategy.full_state_dict(ppo.actor))


# -- LowLevelZero stage 2 behind a stand-in accelerator ----------------------------------------


class _Stream:
    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StandInCuda(CpuAccelerator):
    """ColossalAI's CPU accelerator under the name "cuda", with no-op streams: enough for
    LowLevelZeroOptimizer (which asserts a CUDA or NPU accelerator) to run on CPU tensors."""

    @property
    def name(self) -> str:
        return "cuda"

    def Stream(self, *args, **kwargs) -> _Stream:  # noqa: N802 (ColossalAI's name)
        return _Stream()

    def current_stream(self, *args, **kwargs) -> _Stream:
        return _Stream()

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, *args, **kwargs) -> None:
        pass


def zero2_learner(model_path: str, max_grad_norm: float = 1.0, lora: bool = False) -> PPOLearner:
    set_accelerator(StandInCuda())
    # colossalai_zero2's plugin without overlapping communication (which records CUDA streams),
    # and AdamW for HybridAdam (whose kernels are CUDA extensions)
    recipe = Recipe(lambda precision, max_norm: LowLevelZeroPlugin(
        stage=2, precision=precision, max_norm=max_norm, overlap_communication=False), torch.optim.AdamW)
    strategy = ColossalAIStrategy("colossalai_zero2", "cpu", max_grad_norm, recipe)
    params = PARAMS.with_overrides({"trainer.max_grad_norm": max_grad_norm})
    actor, critic = load_models(model_path)
    return PPOLearner(apply_lora(actor, rank=4, alpha=8.0) if lora else actor, critic, strategy, params, seed=0)


def test_zero2_trains_in_bf16_and_pushes_in_the_models_dtypes(model_path, experience):
    ppo = zero2_learner(model_path)
    assert isinstance(ppo.actor_optim.boosted, LowLevelZeroOptimizer)
    before = ppo.strategy.full_state_dict(ppo.actor)
    metrics = ppo.train_step(experience)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor_grad_norm"] > 0 and metrics["nonfinite_updates"] == 0
    state = ppo.strategy.full_state_dict(ppo.actor)
    working = ppo.strategy.unwrap(ppo.actor).state_dict()
    assert working["transformer.wte.weight"].dtype == torch.bfloat16  # the plugin trains in bf16
    assert all(v.dtype == before[k].dtype == torch.float32 for k, v in state.items() if v.is_floating_point())
    assert_same_tensors(state, {k: v.float() if v.is_floating_point() else v for k, v in working.items()})
    assert not torch.equal(state["transformer.h.0.attn.c_attn.weight"], before["transformer.h.0.attn.c_attn.weight"])


def test_zero2_trains_a_lora_actor_s_adapters_only(model_path, experience):
    ppo = zero2_learner(model_path, lora=True)
    before = ppo.strategy.full_state_dict(ppo.actor)
    ppo.train_step(experience)
    after = ppo.strategy.full_state_dict(ppo.actor)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == trainable_names(ppo.strategy.unwrap(ppo.actor)) and changed
    assert all("lora_" in k for k in changed)


def test_zero2_norm_is_the_one_its_step_clips_with(model_path, experience):
    ppo = zero2_learner(model_path, max_grad_norm=0.1)
    strategy, actor, optimizer = ppo.strategy, ppo.actor, ppo.actor_optim
    out = actor(input_ids=experience.sequences, attention_mask=experience.attention_mask)
    strategy.backward(out.logits.float().pow(2).mean(), actor, optimizer)
    norm = strategy.clip_grad_norm(actor, optimizer, 0.1)
    strategy.step(optimizer, actor)
    assert norm > 0.1
    assert norm == pytest.approx(optimizer.boosted.get_grad_norm(), rel=1e-6)


def test_zero2_optimizer_state_round_trip(model_path, experience):
    ppo = zero2_learner(model_path)
    ppo.train_step(experience)
    state = ppo.strategy.full_optimizer_state_dict(ppo.actor, ppo.actor_optim)
    shapes = [p.shape for p in ppo.strategy.unwrap(ppo.actor).parameters() if p.requires_grad]
    assert [s["exp_avg"].shape for _, s in sorted(state["state"].items())] == shapes  # gathered, unflattened
    other = zero2_learner(model_path)
    other.strategy.load_optimizer_state(other.actor, other.actor_optim, state)
    assert_same_tensors(optimizer_tensors(other.strategy.full_optimizer_state_dict(other.actor, other.actor_optim)),
                        optimizer_tensors(state))


@pytest.mark.parametrize("make_learner", [ddp_learner, zero2_learner], ids=["torch_ddp", "zero2"])
def test_a_skipped_update_leaves_no_trace(model_path, experience, make_learner):
    """What the learner does with a non-finite gradient: zero_grad instead of step. The weights stay,
    and the next update sees only its own gradients."""
    ppo, fresh = make_learner(model_path), make_learner(model_path)

    def backward_and_norm(learner: PPOLearner, loss_fn) -> float:
        out = learner.actor(input_ids=experience.sequences, attention_mask=experience.attention_mask)
        learner.strategy.backward(loss_fn(out.logits.float()), learner.actor, learner.actor_optim)
        return learner.strategy.clip_grad_norm(learner.actor, learner.actor_optim, PARAMS.trainer.max_grad_norm)

    before = ppo.strategy.full_state_dict(ppo.actor)
    # finite loss (0), non-finite gradient: d sqrt(0 * x) / dx = 0 * inf
    assert math.isnan(backward_and_norm(ppo, lambda logits: torch.sqrt(logits * 0).sum()))
    ppo.actor_optim.zero_grad(set_to_none=True)
    assert_same_tensors(ppo.strategy.full_state_dict(ppo.actor), before)

    def loss(logits):
        return logits.pow(2).mean()

    assert backward_and_norm(ppo, loss) == pytest.approx(backward_and_norm(fresh, loss), rel=1e-6)
    ppo.strategy.step(ppo.actor_optim, ppo.actor)
    fresh.strategy.step(fresh.actor_optim, fresh.actor)
    assert_same_tensors(ppo.strategy.full_state_dict(ppo.actor), fresh.strategy.full_state_dict(fresh.actor))

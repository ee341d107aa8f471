"""maker.dtype: a detached maker holds its models in a dtype of its own (bfloat16 generates faster
on GPUs and AMX CPUs); the trainer's float32 pushes are cast to it, the weight check compares the
trainer's state cast the same way, and the experience it makes stays float32."""

import copy

import pytest
import torch

from ray_ppo.config import Config, ConfigError, load_config
from ray_ppo.makers.device_checks import as_stored, bad_item_fields, deliver_push
from ray_ppo.makers.worker import MakerWorker
from ray_ppo.models.sync import as_held, cast_floating, fingerprint, join_state, make_buckets, push_aliases

PROMPTS = [[3, 4, 5], [6, 7, 8, 9]]


def float32_push(worker: MakerWorker, seed: int = 1) -> tuple[dict[str, torch.Tensor], list]:
    """(the trainer's float32 state, its push) for perturbed float32 copies of the maker's models."""
    actor, critic = (copy.deepcopy(m).float() for m in (worker.float_policy, worker.maker.critic))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in [*actor.parameters(), *critic.parameters()]:
            p.add_(0.1 * torch.randn_like(p))
    full = join_state(actor.state_dict(), critic.state_dict())
    aliases = push_aliases(actor, critic)
    push = {k: v for k, v in full.items() if k not in aliases}
    return full, [as_stored(b) for b in make_buckets(push, bucket_mb=0.05)]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_bfloat16_maker_holds_the_trainers_pushes_cast_to_it(tiny_path, zero_copy):
    cfg = Config().with_overrides({"model.pretrained": tiny_path, "maker.max_new_tokens": 6, "maker.dtype": "bfloat16",
                                   "algo.advantage": "gae", "ppo.kl_coef": 0.05, "sync.zero_copy": zero_copy})
    assert (cfg.maker_dtype, cfg.model.dtype) == ("bfloat16", "float32")
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    maker = worker.maker
    for model in (maker.actor, maker.critic, maker.ref):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    items, _ = maker.make_experience(PROMPTS, policy_version=0)
    assert not bad_item_fields(items)
    assert {i.action_log_probs.dtype for i in items} == {i.values.dtype for i in items} == {torch.float32}

    full, push = float32_push(worker)
    assert {v.dtype for v in full.values()} == {torch.float32}
    assert deliver_push(worker, 1, push)
    assert {p.dtype for p in worker.float_policy.parameters()} == {torch.bfloat16}  # cast, not swapped for float32
    assert worker.weights_fingerprint() == (1, fingerprint(cast_floating(full, "bfloat16")))
    assert cast_floating(full, "bfloat16").keys() == full.keys()
    assert fingerprint(as_held(full, cfg.engine_dtype, cfg.maker_dtype)) == fingerprint(cast_floating(full, "bfloat16"))
    assert fingerprint(cast_floating(full, "bfloat16")) != fingerprint(full)
    assert not bad_item_fields(maker.make_experience(PROMPTS, policy_version=1)[0])


@pytest.mark.parametrize("overrides, match", [
    (["maker.dtype=bfloat16", "maker.quantization=int8"],
     r"maker\.quantization='int8' quantizes float32 weights, but maker\.dtype='bfloat16'; set one of them to null"),
    (["maker.dtype=bfloat16", "maker.engine=vllm"],
     r"maker\.dtype='bfloat16' sets an HF maker's weights, but maker\.engine='vllm'; .*maker\.vllm\.dtype=bfloat16"),
])
def test_maker_dtype_refuses_what_it_cannot_go_with(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_weight_check_casts_the_actor_to_the_engines_dtype_and_the_critic_to_the_makers():
    """The end-of-run check fingerprints the trainer's state as each maker holds it: a vLLM
    engine's actor in maker.vllm.dtype, the HF critic beside it in model.dtype."""
    cfg = Config()
    state = join_state({"w": torch.ones(2), "step": torch.tensor(3)}, {"v": torch.ones(2)})
    held = as_held(state, "bfloat16", "float32")
    assert {k: v.dtype for k, v in held.items()} == {"actor.w": torch.bfloat16, "actor.step": torch.int64,
                                                     "critic.v": torch.float32}
    assert (cfg.engine_dtype, cfg.maker_dtype) == ("float32", "float32")
    vllm = Config().model_copy(update={"maker": Config().maker.model_copy(update={
        "engine": "vllm", "vllm": Config().maker.vllm.model_copy(update={"dtype": "bfloat16"})})})
    assert (vllm.engine_dtype, vllm.maker_dtype) == ("bfloat16", "float32")
    bf16 = load_config(None, ["maker.dtype=bfloat16"])
    assert (bf16.engine_dtype, bf16.maker_dtype) == ("bfloat16", "bfloat16")


def test_the_synchronous_loop_refuses_a_maker_dtype_of_its_own():
    """Its maker generates with the learner's live weights: a maker.dtype would be silently ignored."""
    from ray_ppo.local import run_local

    with pytest.raises(ConfigError, match=r"synchronous loop's maker .* not maker\.dtype='bfloat16'; set maker\.dtype=null"):
        run_local(load_config(None, ["maker.dtype=bfloat16", "trainer.total_steps=1"]))

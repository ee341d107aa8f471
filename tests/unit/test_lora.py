"""LoRA-only pushes leave a maker with exactly W0 + scale * B @ A of the latest push."""

import copy

import pytest
import torch

from ray_ppo.config import Config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.makers.worker import _check_keys
from ray_ppo.models.build import build_actor
from ray_ppo.models.lora import trainable_names
from ray_ppo.models.sync import make_buckets, unpack_bucket
from ray_ppo.wire.messages import PushHeader


@pytest.fixture
def cfg(tiny_path):
    return Config().with_overrides({"model.pretrained": tiny_path, "model.lora.rank": 4, "model.lora.alpha": 8.0,
                                    "sync.lora_only": True})


def lora_push(model) -> dict[str, torch.Tensor]:
    """What the trainer sends with sync.lora_only: trainable tensors only, through real buckets."""
    names = trainable_names(model)
    state = {k: v for k, v in model.state_dict().items() if k in names}
    out = {}
    for bucket in make_buckets(state, bucket_mb=0.001):
        out.update({k: v.clone() for k, v in unpack_bucket(bucket).items()})
    return out


def merged(model) -> dict[str, torch.Tensor]:
    return copy.deepcopy(model).merge_and_unload().state_dict()


def test_three_lora_pushes_leave_maker_equal_to_trainer(cfg):
    torch.manual_seed(0)
    trainer_actor, maker_actor = build_actor(cfg), build_actor(cfg)
    base = {k: v.clone() for k, v in maker_actor.state_dict().items() if "lora_" not in k}
    for push in range(3):
        with torch.no_grad():  # a "training step": new adapter values
            for name, p in trainer_actor.named_parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        state = lora_push(trainer_actor)
        assert state and all("lora_" in k for k in state)  # adapters only, nothing else
        _check_keys(maker_actor, state, partial=True, what="actor")
        maker_actor.load_state_dict(state, strict=False)

    trainer_merged, maker_merged = merged(trainer_actor), merged(maker_actor)
    assert trainer_merged.keys() == maker_merged.keys()
    for k in trainer_merged:
        torch.testing.assert_close(maker_merged[k], trainer_merged[k], rtol=0, atol=1e-6)
    # The base W0 was never modified: deltas do not accumulate.
    for k, v in maker_actor.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k
    # And the merged weight really differs from W0 (the adapters did something).
    w0 = base["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"]
    assert not torch.allclose(maker_merged["transformer.h.0.attn.c_attn.weight"], w0)


def test_lora_push_rejects_unknown_tensors(cfg):
    actor = build_actor(cfg)
    with pytest.raises(ValueError, match="unknown"):
        _check_keys(actor, {"not.a.weight": torch.zeros(1)}, partial=True, what="actor")
    with pytest.raises(ValueError, match="missing"):
        _check_keys(actor, lora_push(actor), partial=False, what="actor")


def test_lora_reference_is_the_base_model(cfg):
    maker = build_experience_maker(cfg)
    assert maker.ref is None  # no second copy of the weights
    with torch.no_grad():
        for name, p in maker.actor.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    ids = [[3, 4, 5], [6, 7]]
    items, _ = maker.make_experience(ids, policy_version=0)
    plain = build_actor(cfg, with_lora=False)
    from ray_ppo.algo import ExperienceBatch
    from ray_ppo.models import action_log_probs
    batch = ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)
    expected = action_log_probs(plain, batch.sequences, batch.attention_mask, batch.num_actions) * batch.action_mask
    torch.testing.assert_close(batch.ref_log_probs, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(batch.action_log_probs, batch.ref_log_probs)


def test_lora_only_pushes_through_a_maker_swap_in_only_the_adapters(cfg):
    """The maker's own push path (staged copies, then a swap of the parameters): base weights
    keep their tensors, adapters and value head take the pushed values, twice in a row."""
    from ray_ppo.makers.worker import MakerWorker
    from ray_ppo.models.sync import join_state

    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    trainer_actor, trainer_critic = copy.deepcopy(worker.float_policy), copy.deepcopy(worker.maker.critic)
    base_name = "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"
    base_tensor = worker.float_policy.get_parameter(base_name)
    for version in (1, 2):
        with torch.no_grad():
            for p in [*trainer_actor.parameters(), *trainer_critic.parameters()]:
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        state = join_state(lora_push(trainer_actor), {k: v for k, v in trainer_critic.state_dict().items()
                                                       if k in trainable_names(trainer_critic)})
        worker.weights_start(PushHeader(version, 1, 0, kl_coef=0.05, partial=True))
        worker.receiver.staging.stage(state)
        worker.receiver.staging.seen.add(0)
        assert worker.weights_end(version) is True
    assert worker.float_policy.get_parameter(base_name) is base_tensor  # not swapped, not copied
    for k, v in {**lora_push(trainer_actor)}.items():
        assert torch.equal(worker.float_policy.state_dict()[k], v), k
    torch.testing.assert_close(merged(worker.float_policy), merged(trainer_actor), rtol=0, atol=0)

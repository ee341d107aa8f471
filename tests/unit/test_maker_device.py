"""Where makers run: the device follows ``maker.num_gpus``, every model goes there, items come back on CPU."""

import pytest
import torch

from ray_ppo.config import Config, ConfigError
from ray_ppo.makers.build import build_experience_maker, maker_device
from ray_ppo.makers.device_checks import bad_item_fields, deliver_push, perturbed_push
from ray_ppo.makers.worker import MakerWorker
from ray_ppo.models.sync import fingerprint

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


@pytest.fixture
def cfg(tiny_path):
    return Config().with_overrides({"model.pretrained": tiny_path, "maker.max_new_tokens": 6})


def maker_models(maker) -> dict[str, torch.nn.Module]:
    models = {"actor": maker.actor, "ref": maker.ref, "critic": maker.critic, "reward_model": maker.reward_model}
    return {name: model for name, model in models.items() if model is not None}


def assert_cpu_and_finite(items) -> None:
    assert not bad_item_fields(items)


def new_weights(worker: MakerWorker) -> tuple[dict[str, torch.Tensor], list]:
    """(the trainer's full state, the buckets of its push) for perturbed copies of ``worker``'s
    models: small buckets, so a push spans several."""
    return perturbed_push(worker, scale=0.1, bucket_mb=0.05)


# -- device selection ----------------------------------------------------------------------------


def test_makers_run_on_cpu_without_gpus():
    assert maker_device(Config()) == torch.device("cpu")


def test_makers_with_gpus_use_the_first_visible_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU: it is cuda:0 in the actor's process.
    assert maker_device(Config().with_overrides({"maker.num_gpus": 0.5})) == torch.device("cuda", 0)


def test_makers_with_gpus_but_no_cuda_fail_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"maker.num_gpus=1 but this maker process sees no CUDA device.*"
                                          r"set maker.num_gpus=0"):
        maker_device(Config().with_overrides({"maker.num_gpus": 1}))


# -- placement and output ------------------------------------------------------------------------


@pytest.mark.parametrize("lora_rank, expected", [(0, {"actor", "ref", "critic", "reward_model"}),
                                                 (4, {"actor", "critic", "reward_model"})], ids=["full", "lora"])
def test_every_model_goes_to_the_maker_device(cfg, tiny_reward_path, lora_rank, expected):
    overrides = {"model.reward_pretrained": tiny_reward_path, "model.lora.rank": lora_rank}
    # The meta device stands in for a GPU: a model left behind would still be on the CPU.
    maker = build_experience_maker(cfg.with_overrides(overrides), device=torch.device("meta"))
    models = maker_models(maker)
    assert set(models) == expected  # with LoRA the reference is the actor with its adapters disabled
    for name, model in models.items():
        assert {p.device.type for p in model.parameters()} == {"meta"}, name
    assert maker.device == torch.device("meta")


def test_cpu_maker_items_are_on_cpu_and_finite(cfg, tiny_reward_path):
    maker = build_experience_maker(cfg.with_overrides({"model.reward_pretrained": tiny_reward_path}))
    torch.manual_seed(0)
    items, stats = maker.make_experience(PROMPTS, policy_version=3)
    assert maker.device == torch.device("cpu") and len(items) == stats.num_samples == 3
    assert_cpu_and_finite(items)
    assert all(item.policy_version == 3 for item in items)


def test_behaviour_log_probs_are_generations_own_with_no_forward_pass_of_the_actor(cfg):
    """By default (maker.engine_logprobs null, engine hf) the maker reads the behaviour log-probs from
    generation's logits; with maker.engine_logprobs=false it runs the forward pass it used to. Same
    seed, same samples, the same log-probs to float rounding."""
    def make(overrides: dict):
        maker = build_experience_maker(cfg.with_overrides(overrides))
        passes = []  # use_cache of each actor call: generation steps use the cache, a full pass does not
        maker.actor.register_forward_pre_hook(lambda _, args, kwargs: passes.append(kwargs.get("use_cache")),
                                              with_kwargs=True)
        torch.manual_seed(0)
        items, _ = maker.make_experience(PROMPTS * 4, policy_version=0)
        return items, passes.count(False)

    read, read_passes = make({})
    recomputed, recomputed_passes = make({"maker.engine_logprobs": False})
    assert (read_passes, recomputed_passes) == (0, 1)
    for a, b in zip(read, recomputed, strict=True):
        assert torch.equal(a.response_ids, b.response_ids)
        torch.testing.assert_close(a.action_log_probs, b.action_log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.rewards, b.rewards, atol=1e-5, rtol=0)  # shaped with the KL to the reference


@pytest.mark.parametrize("zero_copy", [True, False])
def test_read_only_push_loads_and_fingerprints_match(cfg, zero_copy):
    worker = MakerWorker(0, cfg.with_overrides({"sync.zero_copy": zero_copy}).to_dict(), coordinator=None)  # no Ray needed
    assert worker.device == torch.device("cpu")
    full, push = new_weights(worker)
    assert deliver_push(worker, 1, push)
    assert worker.weights_fingerprint() == (1, fingerprint(full))
    assert worker.float_policy.lm_head.weight is worker.float_policy.transformer.wte.weight
    pushed = {array.ctypes.data for _, arrays in push for array in arrays}
    held = {p.data_ptr() for p in worker.float_policy.parameters()}
    if zero_copy:  # the weights are the pushed (read-only) arrays themselves; none is staging memory
        assert held <= pushed and not worker.receiver.spares
    else:  # copies of its own; the second push stages into the tensors the first one replaced
        assert not held & pushed and worker.receiver.spares
    full2, push2 = new_weights(worker)
    assert deliver_push(worker, 2, push2)
    assert worker.weights_fingerprint() == (2, fingerprint(full2)) and full2.keys() == full.keys()
    assert fingerprint(full2) != fingerprint(full)
    assert_cpu_and_finite(worker.maker.make_experience(PROMPTS, policy_version=2)[0])


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_maker_generates_on_cuda_and_loads_pushes(cfg, dtype):
    worker = MakerWorker(0, cfg.with_overrides({"maker.num_gpus": 1, "model.dtype": dtype}).to_dict(), None)
    assert worker.device.type == "cuda"
    for name, model in maker_models(worker.maker).items():
        assert {p.device.type for p in model.parameters()} == {"cuda"}, name
    assert_cpu_and_finite(worker.maker.make_experience(PROMPTS, policy_version=0)[0])
    full, push = new_weights(worker)
    assert deliver_push(worker, 1, push)
    assert worker.weights_fingerprint() == (1, fingerprint(full))
    assert_cpu_and_finite(worker.maker.make_experience(PROMPTS, policy_version=1)[0])

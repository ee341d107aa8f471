"""trainer.autocast: the trainer's forward passes run in bfloat16 under torch.autocast while its
weights, gradients and optimizer states stay float32; the settings it cannot go with are refused."""

import pytest
import torch

from ray_ppo.algo import ExperienceBatch
from ray_ppo.config import ConfigError, load_config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.models.build import build_actor, build_critic
from ray_ppo.train.learner import PPOLearner
from ray_ppo.train.strategies import LocalStrategy


def config(tiny_path, autocast: bool):
    return load_config(None, [f"model.pretrained={tiny_path}", "trainer.train_batch_size=8",
                              "trainer.mini_batch_size=4", "trainer.ppo_epochs=1", f"trainer.autocast={autocast}"])


@pytest.fixture
def batch(tiny_path):
    torch.manual_seed(0)
    maker = build_experience_maker(config(tiny_path, False))
    items, _ = maker.make_experience([[3, 4, 5]] * 4 + [[6, 7]] * 4, policy_version=0)
    return ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)


def step(tiny_path, batch, autocast: bool):
    """One learner step; the dtypes the actor's and critic's linear layers computed in, and the learner."""
    cfg = config(tiny_path, autocast)
    torch.manual_seed(1)
    learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg, seed=2)
    seen = set()
    for model in (learner.actor, learner.critic):
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
                module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    return learner.train_step(batch, version=1), seen, learner


def test_autocast_computes_in_bfloat16_and_keeps_float32_weights(tiny_path, batch):
    plain, plain_seen, _ = step(tiny_path, batch, autocast=False)
    mixed, mixed_seen, learner = step(tiny_path, batch, autocast=True)
    assert plain_seen == {torch.float32} and mixed_seen == {torch.bfloat16}
    for model, optim in ((learner.actor, learner.actor_optim), (learner.critic, learner.critic_optim)):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters() if p.grad is not None} <= {torch.float32}
        assert {v.dtype for s in optim.state.values() for v in s.values() if v.dim()} == {torch.float32}
    assert mixed["nonfinite_updates"] == 0 and mixed.keys() == plain.keys()
    assert [k for k, v in mixed.items() if v != v] == [k for k, v in plain.items() if v != v]  # nan where float32's is
    # the same step, computed in bfloat16: close to float32's, not equal to it
    assert mixed["entropy"] == pytest.approx(plain["entropy"], rel=0.02)
    assert mixed["value_loss"] == pytest.approx(plain["value_loss"], rel=0.05)
    assert mixed["behaviour_kl"] < 1e-3 and mixed["is_weight_mean"] == pytest.approx(1.0, abs=0.02)
    assert mixed["entropy"] != plain["entropy"]


def test_autocast_refuses_weights_other_than_float32():
    with pytest.raises(ConfigError, match=r"trainer\.autocast=true .* model\.dtype='bfloat16'; set model\.dtype=float32"):
        load_config(None, ["trainer.autocast=true", "model.dtype=bfloat16"])


def test_autocast_refuses_colossalai_which_sets_its_own_precision(monkeypatch):
    import ray_ppo.config.schema as config_module

    monkeypatch.setattr(config_module, "check_strategy_available", lambda strategy: None)  # as on a CUDA machine
    with pytest.raises(ConfigError, match=r"trainer\.autocast=true with trainer\.strategy='colossalai_zero2'"):
        load_config(None, ["trainer.autocast=true", "trainer.strategy=colossalai_zero2", "trainer.use_gpu=true"])


def test_cpu_has_bfloat16_reads_what_the_cpu_reports():
    from pathlib import Path

    from ray_ppo.config.preflight import cpu_has_bfloat16

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to check torch's probe against (not Linux)")
    flags = {flag for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
             for flag in line.split(":", 1)[1].split()}
    assert cpu_has_bfloat16() == bool(flags & {"avx512_bf16", "amx_tile"})


@pytest.mark.parametrize("has", [False, True, None])
def test_bfloat16_on_a_cpu_without_bfloat16_arithmetic_warns_once_per_role(tiny_path, monkeypatch, has):
    import warnings

    from ray_ppo.config import preflight

    monkeypatch.setattr(preflight, "cpu_has_bfloat16", lambda: has)
    cfg = load_config(None, [f"model.pretrained={tiny_path}", "trainer.autocast=true", "maker.dtype=bfloat16"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PPOLearner(build_actor(cfg), None, LocalStrategy(), cfg)
        build_experience_maker(cfg)
        build_experience_maker(cfg.model_copy(update={"maker": cfg.maker.model_copy(update={"dtype": None})}))
    slow = [str(w.message) for w in caught if issubclass(w.category, preflight.SlowDtypeWarning)]
    if has is not False:  # a CPU with bfloat16 arithmetic, or one torch cannot tell about: nothing to say
        assert slow == []
        return
    assert len(slow) == 2  # the learner's autocast and the maker's bfloat16 weights; float32 makers say nothing
    assert slow[0].startswith("trainer.autocast=true computes in bfloat16, but this CPU has no bfloat16 arithmetic")
    assert slow[1].startswith("maker.dtype='bfloat16' computes in bfloat16")
    assert all("use float32 on this machine (maker.dtype=float32, trainer.autocast=false" in m for m in slow)


def test_pre_flight_names_each_role_that_computes_in_bfloat16_on_the_cpu(monkeypatch):
    import warnings

    from ray_ppo.config import ConfigWarning, preflight

    monkeypatch.setattr(preflight, "cpu_has_bfloat16", lambda: False)

    def said(*overrides):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight.warn_slow_bfloat16_run(load_config(None, list(overrides)))
        assert all(issubclass(w.category, ConfigWarning) for w in caught)  # the CLI prints each as one line
        return [str(w.message).split(" computes")[0] for w in caught]

    assert said() == []
    assert said("trainer.autocast=true", "maker.dtype=bfloat16") == ["trainer.autocast=true", "maker.dtype='bfloat16'"]
    assert said("model.dtype=bfloat16") == ["model.dtype='bfloat16'", "model.dtype='bfloat16'"]  # trainer and makers
    assert said("trainer.autocast=true", "trainer.use_gpu=true") == []
    assert said("maker.dtype=bfloat16", "maker.num_gpus=1") == []

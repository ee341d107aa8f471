"""The step's proximal log-probs: the first minibatch's come from its own update's forward pass
(saving a no-grad pass over those rows); the step must equal one that computes them all first."""

import pytest
import torch

from ray_ppo.algo import ExperienceBatch
from ray_ppo.config import Config
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.models.build import build_actor, build_critic
from ray_ppo.train.learner import PPOLearner, Proximal
from ray_ppo.train.strategies import LocalStrategy


class SeparatePass(PPOLearner):
    """The proximal log-probs of every row from one no-grad pass before the step (the reference)."""

    def _proximal(self, batch, behaviour_is_policy, first):
        if self.ppo.off_policy == "none" or behaviour_is_policy:
            return super()._proximal(batch, behaviour_is_policy, first)
        return Proximal(self._log_probs(batch), batch.action_mask)


def config(tiny_path, off_policy: str, mini_batch_size: int) -> Config:
    return Config().with_overrides({"model.pretrained": tiny_path, "trainer.train_batch_size": 8,
                                    "trainer.mini_batch_size": mini_batch_size, "trainer.ppo_epochs": 2,
                                    "ppo.off_policy": off_policy})


@pytest.fixture
def stale_batch(tiny_path):
    """A batch whose behaviour log-probs are not the learner's (as a maker's stale batch)."""
    torch.manual_seed(0)
    maker = build_experience_maker(config(tiny_path, "decoupled", 8))
    items, _ = maker.make_experience([[3, 4, 5]] * 4 + [[6, 7]] * 4, policy_version=0)
    batch = ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)
    noise = 0.3 * torch.randn(batch.action_log_probs.shape, generator=torch.Generator().manual_seed(1))
    batch.action_log_probs = torch.where(batch.action_mask, batch.action_log_probs + noise, 0.0)
    return batch


@pytest.mark.parametrize("off_policy", ["decoupled", "tis"])
@pytest.mark.parametrize("mini_batch_size", [8, 4])
def test_a_step_equals_one_with_a_separate_proximal_pass(tiny_path, stale_batch, off_policy, mini_batch_size):
    cfg = config(tiny_path, off_policy, mini_batch_size)
    torch.manual_seed(2)
    fused = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg, seed=3)
    torch.manual_seed(2)
    reference = SeparatePass(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg, seed=3)
    calls = {"fused": 0, "reference": 0}
    for name, learner in (("fused", fused), ("reference", reference)):
        def count(*args, _name=name, _pass=learner._log_probs, **kwargs):
            calls[_name] += 1
            return _pass(*args, **kwargs)
        learner._log_probs = count
    got = fused.train_step(stale_batch.select(range(8)), version=1)
    want = reference.train_step(stale_batch.select(range(8)), version=1)
    assert calls == {"fused": 0 if mini_batch_size == 8 else 1, "reference": 1}
    assert got.keys() == want.keys() and "is_weight_mean" in got and "behaviour_kl" in got
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    for (name, a), b in zip(fused.actor.state_dict().items(), reference.actor.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert got["behaviour_kl"] > 1e-3  # the batch is off-policy: the weights are not all 1


def test_without_correction_or_when_the_policy_sampled_no_forward_pass_is_made(tiny_path, stale_batch):
    for off_policy, behaviour_is_policy in (("none", False), ("decoupled", True)):
        cfg = config(tiny_path, off_policy, 4)
        learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg)
        learner._log_probs = lambda *a, **k: pytest.fail("no proximal forward pass expected")
        metrics = learner.train_step(stale_batch.select(range(8)), behaviour_is_policy=behaviour_is_policy)
        assert ("behaviour_kl" in metrics) == (off_policy == "decoupled")
        if behaviour_is_policy:
            assert metrics["behaviour_kl"] == 0.0 and metrics["is_weight_mean"] == pytest.approx(1.0)


def test_the_first_minibatch_must_be_the_one_pending():
    proximal = Proximal(torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool), pending=torch.tensor([2, 0]))
    with pytest.raises(RuntimeError, match="first minibatch"):
        proximal.rows(torch.tensor([1, 3]), torch.randn(2, 3))
    rows = proximal.rows(torch.tensor([2, 0]), torch.full((2, 3), -1.5, requires_grad=True))
    assert not rows.requires_grad and torch.equal(proximal.anchor[[2, 0]], torch.full((2, 3), -1.5))
    assert torch.equal(proximal.rows(torch.tensor([1]), torch.zeros(1, 3)), torch.zeros(1, 3))  # filled once

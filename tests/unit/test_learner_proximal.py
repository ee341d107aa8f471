"""The step's proximal log-probs: the first minibatch's come from its own update's forward pass
(saving a no-grad pass over those rows); the step must equal one that computes them all first.
``ppo.proximal=interpolate`` estimates the other rows' without a pass (AReaL's approximation)."""

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

    def _proximal(self, batch, behaviour_is_policy, first, version=None):
        if self.ppo.off_policy == "none" or behaviour_is_policy:
            return super()._proximal(batch, behaviour_is_policy, first, version)
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
    assert got["tokens_computed"] < want["tokens_computed"]  # the reference's separate pass
    for key in set(want) - set(fused.work):  # the step's work and its timing differ, not its results
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
    proximal = Proximal(torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool), first=torch.tensor([2, 0]))
    with pytest.raises(RuntimeError, match="first minibatch"):
        proximal.rows(torch.tensor([1, 3]), torch.randn(2, 3))
    rows = proximal.rows(torch.tensor([2, 0]), torch.full((2, 3), -1.5, requires_grad=True))
    assert not rows.requires_grad and torch.equal(proximal.anchor[[2, 0]], torch.full((2, 3), -1.5))
    assert torch.equal(proximal.rows(torch.tensor([1]), torch.zeros(1, 3)), torch.zeros(1, 3))  # filled once


def test_interpolation_fills_each_row_at_its_first_update_from_its_staleness():
    """log pi_prox = log pi_b + s / (s + 1) * (log pi_theta - log pi_b), worked out by hand for rows of
    staleness 0, 1 and 3; the first minibatch's rows are exact; each row is filled once, off the mask 0."""
    behaviour = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-3.0, 0.0], [-0.5, -0.5]])
    mask = torch.tensor([[True, True], [True, True], [True, False], [True, True]])
    staleness = torch.tensor([[0.0], [1.0], [3.0], [1.0]])
    proximal = Proximal(torch.zeros(4, 2), mask, first=torch.tensor([3]),
                        interpolate=(behaviour, staleness / (staleness + 1)))
    assert torch.equal(proximal.rows(torch.tensor([3]), torch.tensor([[-0.7, -0.9]])), torch.tensor([[-0.7, -0.9]]))
    theta = torch.tensor([[-2.0, -1.0], [-2.0, -1.0], [-1.0, -5.0]], requires_grad=True)
    got = proximal.rows(torch.tensor([0, 1, 2]), theta)
    want = torch.tensor([[-1.0, -2.0],         # staleness 0: the behaviour policy is the proximal one
                         [-1.5, -1.5],         # 1: halfway, -1 + 0.5 * (-2 - -1), -2 + 0.5 * (-1 - -2)
                         [-1.5, 0.0]])         # 3: -3 + 0.75 * (-1 - -3); off the mask 0
    assert not got.requires_grad and torch.allclose(got, want)
    again = proximal.rows(torch.tensor([1, 0]), torch.zeros(2, 2))  # a later epoch: the anchors stand
    assert torch.allclose(again, want[[1, 0]])


def test_an_interpolating_step_makes_no_forward_pass_and_anchors_each_row_by_its_staleness(
        tiny_path, stale_batch, monkeypatch):
    """A step with ``ppo.proximal=interpolate`` never calls the no-grad pass. The first minibatch's
    anchors are its own log-probs; every other row's, at its first update, are the behaviour
    log-probs moved s / (s + 1) of the way to the log-probs that update computed (0 of the way for
    fresh experience, 2/3 at staleness 2)."""
    cfg = config(tiny_path, "decoupled", 4).with_overrides({"ppo.proximal": "interpolate"})
    torch.manual_seed(2)
    learner = PPOLearner(build_actor(cfg), build_critic(cfg), LocalStrategy(), cfg, seed=3)
    learner._log_probs = lambda *a, **k: pytest.fail("no proximal forward pass expected")
    seen, rows = [], Proximal.rows
    monkeypatch.setattr(Proximal, "rows", lambda self, idx, log_probs: seen.append(
        (idx.clone(), log_probs.detach().clone(), rows(self, idx, log_probs).clone())) or seen[-1][2])
    batch = stale_batch.select(range(8))
    for version, alpha in ((0, 0.0), (2, 2 / 3)):
        seen.clear()
        learner.train_step(batch, version=version)
        (first, theta, anchor), (idx, later_theta, later) = seen[0], seen[1]  # the step's first two updates
        mask = batch.action_mask
        assert torch.allclose(anchor, torch.where(mask[first], theta, 0.0))
        b = batch.action_log_probs[idx]
        assert torch.allclose(later, torch.where(mask[idx], b + alpha * (later_theta - b), 0.0), atol=1e-6)


def test_interpolation_needs_an_off_policy_correction():
    from ray_ppo.config import ConfigError

    with pytest.raises(ConfigError, match="ppo.proximal=interpolate .* ppo.off_policy=none"):
        Config().with_overrides({"ppo.proximal": "interpolate", "ppo.off_policy": "none"})

"""Token-budget micro-batches (``trainer.max_tokens_per_microbatch``): a minibatch cut into passes
of at most the budget's tokens, gradients accumulated into one optimizer update that equals the
update of one pass over the whole minibatch (float32, 1e-5), packed or padded, for every loss
aggregation, with a critic, and with the first minibatch's proximal log-probs coming in parts."""

from __future__ import annotations

import pytest
import torch

from ray_ppo.algo import ExperienceBatch, ExperienceItem, aggregate_loss, aggregate_share
from ray_ppo.config import Config
from ray_ppo.models.build import build_actor, build_critic_if_needed
from ray_ppo.models.packing import micro_batches, pass_tokens
from ray_ppo.train.learner import PPOLearner
from ray_ppo.train.strategies import LocalStrategy


def batch(vocab: int, seed: int = 0) -> ExperienceBatch:
    """Eight rows: four prompts (of 3 to 6 tokens) answered twice each, answers of 1 to 7 tokens,
    random advantages, returns and behaviour log-probs, one row with a hole in its action mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (3, 6, 4, 5)]
    items = []
    for i in range(8):
        r = int(torch.randint(1, 8, (1,), generator=g))
        def per_token(name, r=r):
            return torch.randn(r, generator=g) * 0.5 - (1.0 if name == "action_log_probs" else 0.0)

        item = ExperienceItem.filled(prompts[i // 2], torch.randint(1, vocab, (r,), generator=g), per_token,
                                     reward=0.0, policy_version=0, uid=str(i))
        if i == 5 and r > 2:
            item.action_mask = torch.ones(r, dtype=torch.bool)
            item.action_mask[1] = False
        items.append(item)
    return ExperienceBatch.merge(items, pad_token_id=0)


def test_micro_batches_keep_to_the_budget_and_keep_prompt_groups_whole_where_they_fit():
    b = batch(vocab=16)
    args = (b.sequences, b.attention_mask, b.num_actions)
    whole = pass_tokens(*args, list(range(8)), packed=True)
    budget = whole // 3
    parts = micro_batches(*args, budget, packed=True)
    assert sorted(r for p in parts for r in p) == list(range(8))
    assert all(pass_tokens(*args, p, packed=True) <= budget or len(p) == 1 for p in parts)
    assert len(parts) > 1 and any(p[:2] in ([0, 1], [2, 3], [4, 5], [6, 7]) for p in parts)
    assert micro_batches(*args, 0, packed=True) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    padded = micro_batches(*args, 2 * b.sequences.shape[1], packed=False)
    assert padded == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(micro_batches(*args, 0, packed=True, at_least=5)) == 5  # as many as another rank's


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_shares_of_a_split_sum_to_the_whole_s_loss(loss_agg):
    loss = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    parts = [[0, 2], [1], [3, 4]]
    split = sum(aggregate_share(mask[p], mask, loss_agg) * aggregate_loss(loss[p], mask[p], loss_agg) for p in parts)
    torch.testing.assert_close(split, aggregate_loss(loss, mask, loss_agg))


def first_update_gradients(cfg: Config, b: ExperienceBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients the step's first optimizer update applies (actor and critic), and the step's metrics."""
    torch.manual_seed(0)
    learner = PPOLearner(build_actor(cfg), build_critic_if_needed(cfg), LocalStrategy(), cfg, seed=0)
    grads: dict[str, torch.Tensor] = {}
    step = learner.strategy.step

    def record(optim, model):
        if not any(k.startswith(type(model).__name__) for k in grads):
            grads.update({f"{type(model).__name__}.{n}": p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})
        step(optim, model)

    learner.strategy.step = record
    metrics = learner.train_step(b, version=1)
    return grads, metrics


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("advantage,loss_agg", [("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                                ("gae", "seq_mean_token_sum")])
def test_an_update_in_micro_batches_equals_one_pass(tiny_path, packing, advantage, loss_agg):
    cfg = Config().with_overrides({
        "model.pretrained": tiny_path, "model.packing": packing, "algo.advantage": advantage,
        "maker.samples_per_prompt": 2, "maker.batch_size": 4, "trainer.train_batch_size": 8, "trainer.mini_batch_size": 8,
        "ppo.loss_agg": loss_agg, "ppo.off_policy": "decoupled", "ppo.entropy_coef": 0.01,
        "ppo.kl_coef": 0.05, "ppo.kl_in": "loss"})
    b = batch(vocab=build_actor(cfg).config.vocab_size)
    whole_grads, whole = first_update_gradients(cfg, b)
    budget = pass_tokens(b.sequences, b.attention_mask, b.num_actions, list(range(8)), packing) // 3
    split_grads, split = first_update_gradients(cfg.with_overrides({"trainer.max_tokens_per_microbatch": budget}), b)
    assert whole_grads.keys() == split_grads.keys() and any("Critic" in k for k in whole_grads) == (advantage == "gae")
    for name in whole_grads:
        torch.testing.assert_close(split_grads[name], whole_grads[name], atol=1e-5, rtol=0, msg=name)
    for key in ("policy_loss", "entropy", "kl_loss", "clipfrac", "approx_kl") + (("value_loss",) if advantage == "gae" else ()):
        assert split[key] == pytest.approx(whole[key], abs=1e-5), key


def _ddp_first_gradients(rank: int, port: int, budget: int, path: str, out: dict) -> None:
    """One DDP step on a two-process gloo group, rank 1's batch longer than rank 0's, so it needs
    more micro-batches under ``budget``; records the averaged gradients the first update applies."""
    import os

    import torch.distributed as dist

    from ray_ppo.train.strategies import DDPStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RAY_PPO_CACHE=os.path.dirname(path))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = Config().with_overrides({
            "model.pretrained": path, "maker.samples_per_prompt": 2, "maker.batch_size": 4,
            "trainer.train_batch_size": 8, "trainer.mini_batch_size": 8, "trainer.max_tokens_per_microbatch": budget})
        torch.manual_seed(0)
        learner = PPOLearner(build_actor(cfg), None, DDPStrategy(), cfg, seed=0)
        b = batch(vocab=learner.actor.module.config.vocab_size, seed=rank)
        if rank == 0:  # one token a response: the fewest micro-batches
            b = ExperienceBatch.merge([ExperienceItem.filled(i.prompt_ids, i.response_ids[:1], reward=0.0,
                                                             policy_version=0, uid=i.uid) for i in b.split()], 0)
        parts = []
        cut = learner._micro_batches
        learner._micro_batches = lambda mb, model: parts.append(cut(mb, model)) or parts[-1]
        step = learner.strategy.step
        grads = {}

        def record(optim, model):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            step(optim, model)

        learner.strategy.step = record
        learner.train_step(b, version=0)
        alone = micro_batches(b.sequences, b.attention_mask, b.num_actions, budget, packed=True) if budget else [0]
        out[rank] = (len(parts[0]), len(alone), grads)
    finally:
        dist.destroy_process_group()


def _ddp_run(budget: int, path: str) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ddp_first_gradients, args=(port, budget, path, out), nprocs=2)
        return dict(out)


def test_ranks_that_need_different_numbers_of_micro_batches_cut_as_many_and_match_one_pass(tiny_path):
    whole = _ddp_run(0, tiny_path)
    split = _ddp_run(40, tiny_path)
    (n0, alone0, g0), (n1, alone1, g1) = split[0], split[1]
    assert n0 == n1 == alone1 > alone0  # rank 0 cut as many as rank 1 needed, more than it needed alone
    assert g0.keys() == whole[0][2].keys() and g0
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], atol=0, rtol=0)  # DDP's average, alike on both ranks
        torch.testing.assert_close(g0[name], whole[0][2][name], atol=1e-5, rtol=0, msg=name)

"""``ContinuousBatcher``: sequences admitted into freed slots decode exactly as they would alone
(tokens and log-probs), a weight swap between steps is recorded per token, and a recomputed cache
is exact under the new weights."""

from __future__ import annotations

import random

import pytest
import torch

from ray_ppo.config import Config
from ray_ppo.models import action_log_probs, generate, load_tokenizer, stop_token_ids
from ray_ppo.models.build import build_actor, resolve_config, tokenizer_path
from ray_ppo.models.continuous import ContinuousBatcher, Request

CFG = resolve_config(Config().with_overrides({"maker.max_new_tokens": 10, "maker.temperature": 0.7, "maker.top_k": 8}))


def perturbed_actor(seed: int) -> torch.nn.Module:
    """The tiny actor with noise on every weight, so that its answers differ by prompt."""
    torch.manual_seed(0)
    actor = build_actor(CFG).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return actor


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_path(CFG))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 12) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def forward_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-probs of ``tokens`` after ``prompt`` from one forward pass of the whole sequence, alone."""
    sequence = torch.tensor([prompt + tokens])
    return action_log_probs(model, sequence, torch.ones_like(sequence), len(tokens), CFG.maker.temperature)[0]


def test_refilled_slots_sample_with_the_log_probs_of_a_forward_pass_alone(tokenizer):
    actor = perturbed_actor(1)
    caps = [10, 2, 7, 1, 10, 3, 5, 9, 2, 4, 6, 8]
    requests = [Request(i, p, cap) for i, (p, cap) in enumerate(zip(prompts(len(caps)), caps))]
    batcher = ContinuousBatcher(actor, CFG.maker, tokenizer.pad_token_id, stop_token_ids(tokenizer, actor),
                                max_running=3, generator=torch.Generator().manual_seed(0))
    out = batcher.run(requests)
    assert [f.key for f in out] == list(range(len(caps)))
    assert len({len(f.tokens) for f in out}) > 2  # uneven lengths: slots were refilled at different steps
    for f, cap in zip(out, caps):
        assert len(f.tokens) <= cap and (f.stopped or len(f.tokens) == cap)
        expected = forward_log_probs(actor, f.prompt, f.tokens)
        torch.testing.assert_close(torch.tensor(f.log_probs), expected, atol=1e-4, rtol=1e-4)
        assert f.versions == [0] * len(f.tokens) and f.swaps == 0


def test_greedy_answers_equal_generate_one_prompt_at_a_time(tokenizer):
    actor = perturbed_actor(2)
    stops = stop_token_ids(tokenizer, actor)
    ps = prompts(9, seed=3)
    alone = [generate(actor, [p], CFG.maker, tokenizer.pad_token_id, stops, greedy=True).responses(stops)[0][0]
             for p in ps]
    assert len({tuple(a) for a in alone}) > 3  # the answers differ by prompt
    batcher = ContinuousBatcher(actor, CFG.maker, tokenizer.pad_token_id, stops, max_running=4, greedy=True)
    assert [f.tokens for f in batcher.run(Request(i, p) for i, p in enumerate(ps))] == alone


def test_a_long_answer_does_not_hold_the_other_slot():
    """One answer of 12 tokens beside five of 2, two slots: the short ones are made one after the
    other in the second slot while the long one runs, in the long one's 11 decode steps (its first
    token comes from its prefill); batch by batch it would take 11 + 1 + 1. The second slot runs in
    5 of the 11 steps (each short answer's one decode step)."""
    actor = perturbed_actor(3)
    batcher = ContinuousBatcher(actor, CFG.maker, pad_token_id=0, stop_ids=[], max_running=2)
    out = batcher.run([Request("long", [3, 4], 12)] + [Request(i, [5, 6, 7], 2) for i in range(5)])
    assert [len(f.tokens) for f in out] == [12, 2, 2, 2, 2, 2]
    assert batcher.steps == 11 and batcher.slot_steps == 11 + 5 and batcher.utilisation == 16 / 22


@pytest.mark.parametrize("schedule,steps", [("fifo", 11), ("longest_first", 9)])
def test_longest_first_starts_the_long_answer_before_the_short_ones(schedule, steps):
    """Four 2-token answers queued before one of 10, two slots. In order, the long one starts after
    the short ones (2 + 9 decode steps); longest first, it starts at once and the short ones pass
    beside it (9 steps)."""
    batcher = ContinuousBatcher(perturbed_actor(3), CFG.maker, pad_token_id=0, stop_ids=[], max_running=2,
                                schedule=schedule)
    out = batcher.run([Request(i, [5, 6], 2, expected_len=2) for i in range(4)] + [Request("long", [3], 10, 10)])
    assert [len(f.tokens) for f in out] == [2, 2, 2, 2, 10] and batcher.steps == steps


@pytest.mark.parametrize("kv_at_swap", ["keep", "recompute"])
def test_a_swap_between_steps_is_recorded_per_token(kv_at_swap, tokenizer):
    old, new = perturbed_actor(4), perturbed_actor(5)
    model = perturbed_actor(4)
    batcher = ContinuousBatcher(model, CFG.maker, tokenizer.pad_token_id, stop_ids=[], max_running=2,
                                kv_at_swap=kv_at_swap, version=3, generator=torch.Generator().manual_seed(1))
    batcher.submit([Request("a", [3, 4, 5], 8), Request("b", [6], 8)])
    for _ in range(3):
        assert batcher.step() == []
    batcher.swap(lambda: model.load_state_dict(new.state_dict()), version=4)
    assert (batcher.kv_kept, batcher.kv_recomputed) == ((2, 0) if kv_at_swap == "keep" else (0, 2))
    done = []
    while batcher.busy:
        done += batcher.step()
    for f in done:
        assert f.versions == [3] * 4 + [4] * 4 and f.version_runs == [(3, 4), (4, 4)] and f.swaps == 1
        before = forward_log_probs(old, f.prompt, f.tokens)[:4]
        after = forward_log_probs(new, f.prompt, f.tokens)[4:]
        torch.testing.assert_close(torch.tensor(f.log_probs[:4]), before, atol=1e-4, rtol=1e-4)
        if kv_at_swap == "recompute":  # exact: the new weights over the whole context
            torch.testing.assert_close(torch.tensor(f.log_probs[4:]), after, atol=1e-4, rtol=1e-4)
        else:  # the context before the swap stays encoded by the old weights
            assert not torch.allclose(torch.tensor(f.log_probs[4:]), after, atol=1e-3)


def test_bad_settings_are_refused_with_the_value(tokenizer):
    actor = perturbed_actor(1)
    with pytest.raises(ValueError, match="max_running=0"):
        ContinuousBatcher(actor, CFG.maker, 0, [], max_running=0)
    with pytest.raises(ValueError, match="kv_at_swap='drop'"):
        ContinuousBatcher(actor, CFG.maker, 0, [], max_running=1, kv_at_swap="drop")
    with pytest.raises(ValueError, match="schedule='sjf'"):
        ContinuousBatcher(actor, CFG.maker, 0, [], max_running=1, schedule="sjf")
    with pytest.raises(ValueError, match="empty prompt"):
        ContinuousBatcher(actor, CFG.maker, 0, [], max_running=1).submit([Request("x", [])])


def test_finished_groups_become_experience_with_the_sampler_log_probs_and_the_oldest_version():
    from ray_ppo.makers.build import build_experience_maker

    cfg = resolve_config(Config().with_overrides({"maker.samples_per_prompt": 2, "algo.advantage": "grpo",
                                                  "maker.max_new_tokens": 6}))
    maker = build_experience_maker(cfg, name="m")
    batcher = ContinuousBatcher(maker.actor, cfg.maker, maker.tokenizer.pad_token_id, maker.stop_ids, max_running=3)
    ps = prompts(3, seed=5)
    batcher.submit(Request((k, s), p) for k, p in enumerate(ps) for s in range(2))
    finished = []
    for step in range(100):
        if step == 2:
            batcher.swap(lambda: None, version=1)
        finished += batcher.step()
        if not batcher.busy:
            break
    finished.sort(key=lambda f: f.key)
    items, stats = maker.experience_of(finished, kl_coef=0.0)
    assert len(items) == 6 and stats.num_tokens == sum(len(f.tokens) for f in finished)
    for i, (item, f) in enumerate(zip(items, finished)):  # a group is as old as its oldest sequence
        group = finished[i - i % 2:i - i % 2 + 2]
        assert item.response_ids.tolist() == f.tokens and item.policy_version == min(min(g.versions) for g in group)
        torch.testing.assert_close(item.action_log_probs, torch.tensor(f.log_probs))
    spanning = [f for f in finished if f.versions[0] == 0 and f.versions[-1] == 1]  # running at the swap
    assert spanning and all(items[finished.index(f)].policy_version == 0 for f in spanning)
    for item, f in zip(items, finished):  # runs where the versions differ, else policy_version says it all
        assert item.version_runs == (tuple(f.version_runs) if f in spanning else None)
    with pytest.raises(ValueError, match="whole groups of 2"):
        maker.experience_of(finished[:3])


def test_the_lag_of_trained_tokens_counts_each_token_at_its_own_version():
    from ray_ppo.algo import ExperienceItem
    from ray_ppo.algo.metrics import experience_metrics

    spanning = ExperienceItem.filled(torch.tensor([1]), torch.full((4,), 5), reward=0.0, policy_version=3,
                                     version_runs=((3, 1), (4, 1), (5, 2)))
    whole = ExperienceItem.filled(torch.tensor([1]), torch.full((2,), 5), reward=0.0, policy_version=5)
    metrics = experience_metrics([spanning, whole], version=5)
    # lags 2, 1, 0, 0 and 0, 0 over six tokens; the oldest token bounds the item's staleness
    assert metrics["token_lag_mean"] == pytest.approx(3 / 6) and metrics["token_lag_max"] == 2.0
    assert metrics["swaps_per_sequence"] == 1.0 and metrics["staleness_max"] == 2.0


def test_a_send_of_groups_at_different_versions_goes_as_one_chunk_per_version():
    """A chunk holds one policy version: groups that finish at the same step but started under
    different weights go as separate sends, each listing its own prompts; the blank prompts and
    the times go with the first."""
    from types import SimpleNamespace

    from ray_ppo.makers.build import build_experience_maker
    from ray_ppo.makers.worker import _Unreported
    from ray_ppo.wire.transport import ExperienceChunk

    cfg = resolve_config(Config().with_overrides({"maker.samples_per_prompt": 2, "algo.advantage": "grpo",
                                                  "maker.max_new_tokens": 6}))
    maker = build_experience_maker(cfg, name="m")
    batcher = ContinuousBatcher(maker.actor, cfg.maker, maker.tokenizer.pad_token_id, [], max_running=2)
    batcher.submit([Request((1, 0, s, 10, "p10"), [3, 4]) for s in range(2)])
    batcher.step()
    batcher.swap(lambda: None, version=1)  # group 10 started at v0; group 11 starts at v1
    batcher.submit([Request((1, 1, s, 11, "p11"), [5]) for s in range(2)])
    finished = []
    while batcher.busy:
        finished += batcher.step()
    groups = [[f for f in finished if f.key[1] == k] for k in (0, 1)]
    worker = SimpleNamespace(maker=maker, kl_coef=0.0, items_made=0, batcher=batcher, cfg=cfg,
                             _unreported_pause_s=0.0, _unreported_idle_s=0.0, group_filter=None, maker_id=0)
    unreported = _Unreported()
    unreported.blank_ids, unreported.blank, unreported.generate_s = [12], 1, 2.5
    sends = unreported.send(groups, worker)
    assert [(sorted({it.policy_version for it in items}), stats.prompt_ids) for items, stats in sends] == [
        ([0], (10, 12)), ([1], (11,))]
    assert [(s.num_prompts, s.blank, s.generate_s > 0) for _, s in sends] == [(2, 1, True), (1, 0, False)]
    assert sum(s.num_tokens for _, s in sends) == sum(len(f.tokens) for f in finished)
    for items, _ in sends:  # each is a chunk the sender can pack
        assert ExperienceChunk.of(items, "inline", group_size=2).count == 2

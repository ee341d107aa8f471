"""Bring your own agent without Ray (``ray_ppo.makers.agents``): agent code calls a real endpoint
(Starlette on uvicorn) with the real ``openai`` client; each episode is the exact tokens of its
calls; tool calls round-trip; bad calls and faulty agents end alone.

Two engines stand behind the endpoint: the tiny model's ``ContinuousBatcher`` (exact tokens and
log-probs, the engine's own), and, where an answer must be a tool call, ``Scripted``: a batcher
that answers from a script, because the tiny random model cannot write one. Everything between
the agent and the batcher is the real path."""

import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ray_ppo.config import AgentConfig, Config, ConfigError, EnvConfig
from ray_ppo.makers.agents import AgentRunner
from ray_ppo.makers.build import build_experience_maker
from ray_ppo.models.build import resolve_config
from ray_ppo.models.continuous import ContinuousBatcher, Finished, Slots

DOCS = Path(__file__).parents[2] / "docs" / "multi-turn.md"
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer (every text spells) with ChatML markers and a Hermes-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = HERMES
    return tokenizer


class Scripted(Slots):
    """A batcher that answers each request with ``script(context text, choice)`` and the EOS, every
    token at log-prob -0.5: for answers the tiny model cannot give (a tool call), or not on demand."""

    def __init__(self, tokenizer, script):
        super().__init__(max_running=8, kv_at_swap="keep", schedule="fifo", version=0)
        self.tokenizer, self.script, self.rows, self.params = tokenizer, script, [], None

    def step(self, admit: bool = True) -> list[Finished]:
        done = []
        while self.waiting:
            r = self.waiting.popleft()
            text = self.script(self.tokenizer.decode(r.prompt), r.key[-1])
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = [*ids, self.tokenizer.eos_token_id][:r.max_new_tokens]
            done.append(Finished(r.key, list(r.prompt), ids, [-0.5] * len(ids), [0] * len(ids), True, 0))
        return done


@pytest.fixture(scope="module")
def chat_maker(tiny_model_cache):
    cfg = resolve_config(Config.from_dict({
        "model": {"pretrained": "tiny-chat"}, "data": {"chat_template": True},
        "maker": {"samples_per_prompt": 2, "max_new_tokens": 4, "max_running": 4}, "algo": {"advantage": "grpo"},
        "agent": {"fn": "ray_ppo.tasks.turns:two_turn_agent"}, "env": {"max_tokens": 24}}))
    return build_experience_maker(cfg)


def tiny_batcher(maker, seed: int = 0) -> ContinuousBatcher:
    """The tiny model's batcher; it keeps every sequence it finished in ``finished``."""
    batcher = ContinuousBatcher(maker.actor, maker.sampling, maker.tokenizer.pad_token_id, maker.stop_ids,
                                max_running=4, generator=torch.Generator().manual_seed(seed))
    batcher.finished, step = [], batcher.step

    def recording(admit: bool = True):
        out = step(admit)
        batcher.finished += out
        return out

    batcher.step = recording
    return batcher


def run_agent(fn, tokenizer, batcher, prompts: list, max_new_tokens: int = 4, **agent) -> list:
    """One episode of ``fn`` per prompt through ``batcher``; the ended episodes in order."""
    env = EnvConfig(max_tokens=agent.pop("max_tokens", 24), max_turns=agent.pop("max_turns", 4))
    runner = AgentRunner(fn, AgentConfig(host="127.0.0.1", **agent), env, tokenizer)
    try:
        ids = [tokenizer(p if isinstance(p, str) else p[-1]["content"])["input_ids"] for p in prompts]
        return runner.stream(max_new_tokens).run(batcher, ids, prompts)
    finally:
        runner.close()


def test_an_episode_is_the_exact_tokens_of_its_calls_with_the_engine_s_log_probs(chat_maker):
    """Two calls: the episode is the first call's rendered prompt, the first answer as sampled, the
    second call's added message rendered as an observation, the second answer. The token ids and
    log-probs the endpoint returns, and those the episode trains on, are the engine's."""
    replies = {}

    async def agent(prompt, endpoint):
        client = endpoint.async_client()
        messages = [{"role": "user", "content": prompt}]
        for call in range(2):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages, logprobs=True)
            replies[(prompt, call)] = reply
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "9 9"}]
        return [0.25, 1.0]

    tokenizer, batcher = chat_maker.tokenizer, tiny_batcher(chat_maker)
    ended = run_agent(agent, tokenizer, batcher, ["3 1 4", "2 7 1"])
    engine = {(f.key[4], f.key[-2]): f for f in batcher.finished}  # (prompt, call number) -> the engine's sequence
    for e in ended:
        first, second = engine[(e.prompt, 1)], engine[(e.prompt, 2)]
        for call, f in enumerate((first, second)):
            choice = replies[(e.prompt, call)].choices[0]
            assert choice.token_ids == f.tokens
            assert [t.logprob for t in choice.logprobs.content] == f.log_probs
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}], add_generation_prompt=True,
                                                 tokenize=False)
        assert e.prompt_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        added = chat_maker.episodes.observation_ids([{"role": "user", "content": "9 9"}], True, first.stopped)
        assert e.tokens == first.tokens + added + second.tokens
        assert e.actions == [True] * len(first.tokens) + [False] * len(added) + [True] * len(second.tokens)
        assert e.log_probs == first.log_probs + [0.0] * len(added) + second.log_probs
        assert e.scores[len(first.tokens) - 1] == 0.25 and e.scores[-1] == 1.0 and e.reward == 1.25
        assert second.prompt == e.prompt_ids + first.tokens + added  # call 2 continued the exact tokens
    items, stats = chat_maker.experience_of(ended, prompts=[e.prompt for e in ended])
    assert stats.faults == [] and [it.episode["turns"] for it in items] == [2.0] * 2
    run = chat_maker.episodes.streamed(ended)
    from ray_ppo.models import action_log_probs

    exact = action_log_probs(chat_maker.actor, run.rollout.sequences, run.rollout.attention_mask,
                             run.rollout.num_actions, chat_maker.sampling.temperature)
    mask = run.rollout.action_mask
    assert torch.allclose(run.rollout.log_probs[mask], exact[mask], atol=1e-4)  # a forward pass agrees


def docs_agent():
    """The agent of docs/multi-turn.md's "Bring your own agent", as the page shows it; the page's
    code is ``ray_ppo.tasks.calculator_agent``'s (which configs name)."""
    text = DOCS.read_text()
    block = re.search(r"## Bring your own agent.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    assert block in (Path(__file__).parents[2] / "ray_ppo" / "tasks" / "calculator_agent.py").read_text()
    namespace = {}
    exec(compile(block, str(DOCS), "exec"), namespace)
    return namespace["agent"]


def test_the_docs_calculator_agent_round_trips_a_tool_call():
    """The policy writes a Hermes tool call; the endpoint returns it as an OpenAI tool call, the
    agent runs the calculator and sends back the call and its result, and the episode goes on over
    the exact tokens: the template's rendering of the tool message between the two answers."""
    tokenizer = byte_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call>'
    batcher = Scripted(tokenizer, lambda context, _: "The answer is 10063." if "<|im_start|>tool" in context else call)
    prompt = [{"role": "user", "content": "What is 347 times 29? Give the answer as a number."}]
    [episode] = run_agent(docs_agent(), tokenizer, batcher, [prompt], max_new_tokens=128, max_tokens=256)
    assert episode.fault is None and episode.reward == 1.0 and episode.turns == 2
    text = tokenizer.decode(episode.tokens)
    assert text == f"{call}<|im_end|>\n<|im_start|>tool\n10063<|im_end|>\n<|im_start|>assistant\nThe answer is 10063.<|im_end|>"
    assert tokenizer.decode(episode.prompt_ids).startswith("<|im_start|>system\n<tools>")  # tools rendered


def test_tool_calls_come_back_as_openai_tool_calls_and_are_matched_as_json():
    """The returned message carries the call (content None, finish_reason tool_calls); the agent may
    send its arguments back re-serialised (other spacing, other key order): still the same call."""
    tokenizer = byte_tokenizer()
    seen = []
    call = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": [2, 3]}}</tool_call>'
    batcher = Scripted(tokenizer, lambda context, _: "done" if "<|im_start|>tool" in context else call)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    async def agent(prompt, endpoint):
        client = endpoint.async_client()
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[tool])
        seen.append(reply.choices[0])
        [tc] = reply.choices[0].message.tool_calls
        again = {"id": tc.id, "type": "function",
                 "function": {"name": "f", "arguments": json.dumps({"b": [2, 3], "a": 1}, indent=1)}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [again]},
                     {"role": "tool", "tool_call_id": tc.id, "content": "ok"}]
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[tool])
        return 1.0 if reply.choices[0].message.content == "done" else 0.0

    [episode] = run_agent(agent, tokenizer, batcher, ["go"], max_new_tokens=128, max_tokens=256)
    assert episode.fault is None and episode.reward == 1.0
    choice = seen[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 1, "b": [2, 3]}


def test_bad_calls_get_a_4xx_with_a_message_and_the_key_is_required(chat_maker):
    """From inside a live episode: a wrong key, a body that is not JSON, fields out of range, an
    unknown episode, a prompt longer than data.max_prompt_len, then one good call."""
    found = {}

    async def agent(prompt, endpoint):
        url, good = f"{endpoint.base_url}/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        async with httpx.AsyncClient() as http:
            key = {"Authorization": f"Bearer {endpoint.api_key}"}
            bad = {"no key": (url, good, {}), "wrong key": (url, good, {"Authorization": "Bearer nope"}),
                   "n": (url, {**good, "n": 0}, key), "messages": (url, {"messages": []}, key),
                   "stop": (url, {**good, "stop": [""]}, key), "stream": (url, {**good, "stream": True}, key),
                   "episode": (url.replace("/episodes/", "/episodes/x"), good, key),
                   "long": (url, {"messages": [{"role": "user", "content": " ".join(["1"] * 600)}]}, key)}
            for name, (where, body, headers) in bad.items():
                r = await http.post(where, json=body, headers=headers)
                found[name] = (r.status_code, r.json()["error"]["message"])
            r = await http.post(url, content=b"{not json", headers=key)
            found["json"] = (r.status_code, r.json()["error"]["message"])
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="nope", max_retries=0).models.list()
        async with endpoint.async_client() as client:  # closing it leaves the shared connections open
            models = await client.models.list()
        reply = await endpoint.async_client().chat.completions.create(model=models.data[0].id, **good)
        return float(len(reply.choices[0].token_ids) > 0)

    [episode] = run_agent(agent, chat_maker.tokenizer, tiny_batcher(chat_maker), ["3 1 4"])
    assert episode.fault is None and episode.reward == 1.0
    assert found["no key"][0] == found["wrong key"][0] == 401 and "API key" in found["no key"][1]
    assert found["n"] == (400, "'n' must be a whole number from 1 to 16, not 0")
    assert found["messages"][0] == 400 and "'messages'" in found["messages"][1]
    assert found["stop"][0] == 400 and "'stop'" in found["stop"][1]
    assert found["stream"][0] == 400 and "stream" in found["stream"][1]
    assert found["episode"][0] == 404 and "no running episode" in found["episode"][1]
    assert found["json"][0] == 400 and "not JSON" in found["json"][1]
    assert found["long"][0] == 400 and "more than data.max_prompt_len=512" in found["long"][1]


def test_sync_and_async_agents_run_many_episodes_at_once(chat_maker):
    """32 episodes at once on 4 slots: async agents on the runner's event loop, plain functions in
    its threads (with ``endpoint.client()``, the sync client); each gets its own URL, and every
    episode is whole."""
    urls = set()

    def sync_agent(prompt, endpoint):
        urls.add(endpoint.base_url)
        reply = endpoint.client().chat.completions.create(model=endpoint.model,
                                                          messages=[{"role": "user", "content": prompt}])
        return float(reply.choices[0].finish_reason in ("stop", "length"))

    async def async_agent(prompt, endpoint):
        urls.add(endpoint.base_url)
        await asyncio.sleep(0.05)  # a tool, while the other episodes generate
        reply = await endpoint.async_client().chat.completions.create(model=endpoint.model,
                                                                      messages=[{"role": "user", "content": prompt}])
        return float(reply.choices[0].finish_reason in ("stop", "length"))

    prompts = [f"{i % 10} 1 4" for i in range(32)]
    for fn in (sync_agent, async_agent):
        ended = run_agent(fn, chat_maker.tokenizer, tiny_batcher(chat_maker), prompts)
        assert [e.fault for e in ended] == [None] * 32 and all(e.turns == 1 and e.reward == 1.0 for e in ended)
    assert len(urls) == 64


def test_a_call_that_edits_the_history_is_refused_and_ends_only_its_episode(chat_maker):
    async def agent(prompt, endpoint):
        client = endpoint.async_client()
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
        if prompt.startswith("4"):  # drops the answer it got from the history
            messages.append({"role": "user", "content": "9"})
        else:
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "9"}]
        await client.chat.completions.create(model=endpoint.model, messages=messages)
        return 1.0

    edited, kept = run_agent(agent, chat_maker.tokenizer, tiny_batcher(chat_maker), ["4 1 1", "3 1 1"])
    assert "call 2 of this episode does not extend call 1: it has 2 messages" in edited.fault
    assert edited.turns == 1 and edited.info["history_edited"] == 1.0  # what it had before the edit stays
    assert kept.fault is None and kept.turns == 2 and kept.reward == 1.0


def test_faulty_agents_end_their_episodes_alone(chat_maker):
    """An agent that raises, hangs past agent.timeout_s, returns no number, makes no call, or
    returns a reward list of the wrong length: each episode ends as a fault saying why, and the
    episodes still make experience (keeping the answers sampled; one that made no call gets one
    answer to its prompt, as an environment's episode always holds the policy's first turn)."""
    async def agent(prompt, endpoint):
        if prompt == "1":
            await asyncio.sleep(3600)
        if prompt == "3":
            return 1.0
        reply = await endpoint.async_client().chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": prompt}])
        if prompt == "0":
            raise RuntimeError("the agent broke")
        return {"2": "garbage", "4": [1.0, 2.0], "5": 0.5}[prompt] if reply.choices else 0.0

    ended = run_agent(agent, chat_maker.tokenizer, tiny_batcher(chat_maker), list("012345"), timeout_s=8)
    faults = {e.prompt: e.fault for e in ended}
    assert "the agent raised RuntimeError: the agent broke" in faults["0"]
    assert "longer than agent.timeout_s=8 s" in faults["1"]
    assert "not a finite reward" in faults["2"]
    assert "made no call" in faults["3"]
    assert "2 rewards for 1 calls" in faults["4"]
    assert faults["5"] is None and ended[5].reward == 0.5
    items, stats = chat_maker.experience_of(ended, prompts=[e.prompt for e in ended])
    assert len(stats.faults) == 5 and [it.episode["fault"] for it in items] == [1.0] * 5 + [0.0]
    assert all(it.num_actions > 0 for it in items) and [e.turns for e in ended] == [1] * 6
    assert all(torch.all(it.advantages == 0) for it in items[:5])  # neutral: the group's mean reward


def test_stop_strings_cut_answers_and_the_next_call_picks_one_of_n_choices():
    """``n=2``: the episode goes on with the answer the next call repeats (the second here); ``stop``
    ends the reply's text before the string, and the answer's tokens after it leave the episode
    (the string's own stay: the policy wrote it)."""
    tokenizer = byte_tokenizer()
    answers = {0: "first answer", 1: "second END and more"}
    batcher = Scripted(tokenizer, lambda context, choice: "last" if "<|im_start|>user\ngo on" in context
                       else answers[choice])
    got = []

    async def agent(prompt, endpoint):
        client = endpoint.async_client()
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages, n=2, stop=["END"])
        got.append(reply)
        messages += [reply.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model=endpoint.model, messages=messages)
        return 1.0

    [e] = run_agent(agent, tokenizer, batcher, ["hi"], max_new_tokens=64, max_tokens=256)
    [reply] = got
    assert [c.message.content for c in reply.choices] == ["first answer", "second "]
    assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
    assert e.fault is None and e.turns == 2
    assert tokenizer.decode(e.tokens) == ("second END<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
                                          "<|im_start|>assistant\nlast<|im_end|>")
    assert e.actions.count(True) == len("second END") + len("last") + 1  # a byte a token, and the EOS


def test_calls_past_the_episode_s_budget_get_empty_answers(chat_maker):
    """env.max_turns calls, then every further call gets an empty answer cut at its length (the
    episode ends there, as an environment's does), counted in calls_past_budget; a reward per call
    counts those calls too."""
    reasons = []

    async def agent(prompt, endpoint):
        client = endpoint.async_client()
        messages = [{"role": "user", "content": prompt}]
        for _ in range(4):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
            reasons.append((reply.choices[0].finish_reason, reply.choices[0].message.content))
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "9"}]
        return [0.125, 0.25, 0.5, 1.0]  # one reward per call, the empty ones too

    [e] = run_agent(agent, chat_maker.tokenizer, tiny_batcher(chat_maker), ["3 1 4"], max_turns=2, max_tokens=64)
    assert e.fault is None and e.turns == 2 and e.info["calls_past_budget"] == 2.0
    assert reasons[2:] == [("length", "")] * 2
    assert e.scores[-1] == 0.25 + 0.5 + 1.0 and e.reward == 1.875  # the empty calls' rewards on the last token


def test_config_refuses_an_agent_with_an_environment_or_without_streaming():
    with pytest.raises(ConfigError, match="set maker.max_running"):
        Config.from_dict({"agent": {"fn": "ray_ppo.tasks.turns:two_turn_agent"}})
    with pytest.raises(ConfigError, match="both write the episodes"):
        Config.from_dict({"agent": {"fn": "ray_ppo.tasks.turns:two_turn_agent"}, "maker": {"max_running": 4},
                          "env": {"cls": "ray_ppo.tasks.turns:TwoTurnEnv"}})

"""The toy task over two turns: the smallest multi-turn environment (``ray_ppo.env``).

The policy answers a digit prompt (``ray_ppo.tasks.toy``); the environment shows the prompt's
digits again and the policy answers once more. Each answer earns half the toy reward (the share
of its first ``TARGET_LEN`` tokens equal to the prompt's last digit), so an episode scores in
[0, 1], as a single toy response does, and the tiny built-in model learns it in minutes:

    ray-ppo train env.cls=ray_ppo.tasks.turns:TwoTurnEnv env.max_tokens=32

``two_turn_agent`` is the same task as agent code (``agent.fn``, ``ray_ppo.makers.agents``): it
talks to the maker's OpenAI-compatible endpoint with the ``openai`` client, on the tiny model with a
chat template:

    ray-ppo train model.pretrained=tiny-chat data.chat_template=true maker.max_running=16 \
        agent.fn=ray_ppo.tasks.turns:two_turn_agent env.max_tokens=32
"""

from __future__ import annotations

from ray_ppo.data import Prompt, prompt_text
from ray_ppo.env import Environment, Turn
from ray_ppo.tasks.toy import reward


class TwoTurnEnv(Environment):
    """Two turns; each scores half the toy reward; the observation between them is the prompt again."""

    def __init__(self, prompt: Prompt):
        super().__init__(prompt)
        self.turn = 0

    async def step(self, response: str) -> Turn:
        self.turn += 1
        score = 0.5 * reward([self.prompt], [response])[0]
        if self.turn == 1:
            return Turn(observation=" " + prompt_text(self.prompt), reward=score)
        return Turn(reward=score, done=True)


async def two_turn_agent(prompt: Prompt, endpoint) -> list[float]:
    """``TwoTurnEnv`` as an agent: ask, show the prompt again, ask again; one reward per call."""
    client = endpoint.async_client()
    messages = [{"role": "user", "content": prompt_text(prompt)}]
    rewards = []
    for _ in range(2):
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
        answer = reply.choices[0].message.content or ""
        rewards.append(0.5 * reward([prompt], [answer])[0])
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": prompt_text(prompt)}]
    return rewards

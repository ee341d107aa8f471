"""The toy task over two turns: the smallest multi-turn environment (``ray_ppo.env``).

The policy answers a digit prompt (``ray_ppo.tasks.toy``); the environment shows the prompt's
digits again and the policy answers once more. Each answer earns half the toy reward (the share
of its first ``TARGET_LEN`` tokens equal to the prompt's last digit), so an episode scores in
[0, 1], as a single toy response does, and the tiny built-in model learns it in minutes:

    ray-ppo train env.cls=ray_ppo.tasks.turns:TwoTurnEnv env.max_tokens=32
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

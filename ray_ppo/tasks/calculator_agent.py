"""The calculator task (``ray_ppo.tasks.calculator``) as agent code: the ``openai`` client, one tool.

    ray-ppo train --config configs/smollm2_calculator.yaml env.cls=null \
        agent.fn=ray_ppo.tasks.calculator_agent:agent maker.max_running=32

``agent`` is the example of docs/multi-turn.md ("Bring your own agent"), as the page shows it (a
test keeps the two the same). It does what ``CalculatorEnv`` does, from the other side of the
endpoint: each calculator call the policy writes comes back as an OpenAI tool call, which the agent
runs and answers with a ``tool`` message; the first answer without a call is scored.
"""

import json

from ray_ppo.tasks.arithmetic import reward
from ray_ppo.tools import CALCULATOR, calculate


async def agent(prompt, endpoint):
    """Ask the question; run each calculator call the policy makes; score the first plain answer."""
    client = endpoint.async_client()  # an openai.AsyncOpenAI for this episode
    messages = list(prompt)
    for _ in range(3):
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return reward([prompt], [message.content or ""])[0]
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return 0.0

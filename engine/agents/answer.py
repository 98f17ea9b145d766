"""A built-in environment for tasks whose answer a rule scores (GSM8K, MATH): the model may call
the calculator, in the Hermes form of Qwen2.5/Qwen3 chat templates, before it answers.

    rollout.env=rlflow.engine.agents.answer:WithCalculator reward.function=rlflow.engine.data.rewards:gsm8k_score

A turn that calls the calculator gets its result back as a `tool` message; the first turn without
a call is the answer, which ends the episode. The environment gives no reward of its own: the
answer is scored by `reward.function`, as a single-turn response would be (the `gsm8k-agent` recipe).
"""

from __future__ import annotations

from rlflow.engine.agents.env import Step
from rlflow.engine.agents.tools import CALCULATOR


class WithCalculator:
    tools = [CALCULATOR]
    tool_parser = "hermes"

    def __init__(self, prompt) -> None:
        pass

    def step(self, response: str) -> Step:
        return Step(None, 0.0, True)

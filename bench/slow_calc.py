"""The embedded calculator task (engine/agents/calc.py) with a tool that takes TOOL_S seconds a call
(default 0.2), as a remote sandbox would: generation as long as a training step on the CPU, for
runs that generate ahead (`rollout.env=bench/slow_calc.py:SlowCalculator`)."""

import os
import time
from dataclasses import replace

from rlflow.engine.agents.calc import Calculator
from rlflow.engine.agents.tools import CALCULATOR


def slow_calculate(expression: str) -> str:
    time.sleep(float(os.environ.get("TOOL_S", "0.2")))
    return CALCULATOR.fn(expression)


class SlowCalculator(Calculator):
    tools = [replace(CALCULATOR, fn=slow_calculate)]
    overlap = True  # each episode's call runs while the others decode

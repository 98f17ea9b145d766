"""Environments: the user's side of a multi-turn episode, and how their calls are run.

An environment is a class named by `rollout.env` as "package.module:Class" or
"path/to/file.py:Class", like a reward function. One instance per episode:

    class MyEnv:
        tools = [...]              # optional: engine.agents.tools.Tool, offered through the chat template
        tool_parser = "hermes"     # optional: how calls are read from the model's text (tools.PARSERS)
        overlap = False            # optional: True runs calls while other episodes generate (episodes.py)

        def __init__(self, prompt):              # engine.data.prompts.Prompt: the dataset row
            ...
        def step(self, response: str) -> Step:   # a model turn that called no tool, decoded
            return Step(observation, reward, done)

The row's prompt is the episode's first observation. A model turn that calls tools gets their
results as its observation (the driver runs them, see engine/agents/episodes.py); any other turn
goes to `step`, whose observation (a string: one user message; or chat messages, rendered by the
chat template) follows it, unless `done`. An episode's reward is the sum of its steps' rewards.

Invariants:
- `__init__` and `step` run in threads, all of a turn's episodes at once (with `overlap`, each
  episode's as soon as its turn is sampled), each call bounded by
  `reward.timeout_s`: a call past it is abandoned (its thread left behind, as a reward function's
  is) and its episode ends;
- an environment that raises, times out or returns something that is not a `Step` (or a tuple
  of observation, reward, done) of the right types ends its episode with reward 0 and a counted,
  logged error, or fails the step with the reason under `reward.on_error=raise`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rlflow.engine import progress

if TYPE_CHECKING:
    from rlflow.engine.agents.tools import Tool


@dataclass
class Step:
    observation: str | list[dict] | None  # None: nothing to add (only with done)
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    """An environment class's shape (the module docstring says how an episode uses it); `tools`,
    `tool_parser` and `overlap` are optional."""

    tools: ClassVar[list[Tool]]
    tool_parser: ClassVar[str]  # "hermes" (the default) or "compact"
    overlap: ClassVar[bool]

    def __init__(self, prompt: Any) -> None: ...  # the episode's dataset row, an rlflow.Prompt

    def step(self, response: str) -> Step: ...


def check_environment(env_class: Any) -> None:
    """Raise ValueError naming what in an environment class's tools or parser cannot work."""
    from rlflow.engine.agents.tools import PARSERS, Tool

    tools = getattr(env_class, "tools", []) or []
    bad = [t for t in tools if not isinstance(t, Tool)]
    if bad:
        raise ValueError(f"tools must be engine.agents.tools.Tool, got {type(bad[0]).__name__}")
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise ValueError(f"two tools share a name: {sorted(names)}")
    parser = getattr(env_class, "tool_parser", "hermes")
    if parser not in PARSERS:
        raise ValueError(f"tool_parser={parser!r} is not one of {', '.join(PARSERS)}")


def offered_tools(spec: str) -> list[dict] | None:
    """The JSON-schema descriptions of the tools the environment class `spec` offers (None: no
    environment or no tools): what the chat template renders into its prompts."""
    if not spec:
        return None
    from rlflow.engine.specs import load_function

    return [tool.schema() for tool in getattr(load_function(spec, "environment"), "tools", [])] or None


class CallTimeout(TimeoutError):
    """A user call ran past its deadline; the call itself may still be running, abandoned."""


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[tuple[bool, Any]]:
    """Run `calls` at once, each in a daemon thread, and wait at most `timeout_s` for all of them
    (0 or less: no limit): [(True, result) | (False, exception)], in order. A daemon thread, not a
    pool: a stuck call must not hold the process at exit."""
    out: list[tuple[bool, Any]] = [(False, CallTimeout(f"timed out after {timeout_s:g}s"))] * len(calls)
    done = [threading.Event() for _ in calls]

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = (True, fn())
        except BaseException as e:  # reported to the caller, as a direct call would raise it
            out[i] = (False, e)
        done[i].set()
        progress.tick()

    for i, fn in enumerate(calls):
        threading.Thread(target=run, args=(i, fn), name="rlflow-env", daemon=True).start()
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else math.inf
    for event in done:
        event.wait(None if deadline == math.inf else max(0.0, deadline - time.monotonic()))
    return [out[i] if done[i].is_set() else (False, CallTimeout(f"timed out after {timeout_s:g}s"))
            for i in range(len(calls))]


def as_step(value: Any) -> Step:
    """A `step` result checked: a Step or (observation, reward, done) with a str / messages / None
    observation, a finite reward and a bool done; raises TypeError or ValueError naming the fault."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(*value)
    if not isinstance(value, Step):
        raise TypeError(f"step must return a Step or (observation, reward, done), got {type(value).__name__}")
    obs = value.observation
    if not (obs is None or isinstance(obs, str) or
            (isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in obs))):
        raise TypeError(f"an observation is a str, chat messages or None, got {type(obs).__name__} {obs!r:.60}")
    if obs is None and not value.done:
        raise ValueError("an episode that is not done needs an observation")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise ValueError(f"a step's reward must be a finite number, got {value.reward!r:.60}")
    if not isinstance(value.done, bool):
        raise TypeError(f"done must be a bool, got {type(value.done).__name__}")
    return Step(obs, float(value.reward), value.done)

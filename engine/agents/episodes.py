"""Multi-turn episodes over any rollout engine, token in and token out.

Each turn, every running episode's whole token history (prompt, its sampled turns, its
observations) goes to the engine as the next prompt, as ids: nothing already in the history is
decoded and encoded again, so the ids the trainer trains on are exactly those the engine sampled.
A model turn is decoded once, to read its tool calls or hand it to the environment; an
observation is rendered by the chat template once and encoded once, then appended as ids. The
native engine keeps each history in its slot between turns (engine/rollout/native.py), so a turn
prefills only its new tokens.

Invariants:
- an episode's response is its turns and observations in order; `mask` is 1 on the sampled
  tokens only and `logprobs` hold the engine's logprobs there, 0 under observations;
- `rewards` holds each step's reward on the last token of the turn it answered, so estimators
  with per-token returns see when it was earned; they sum to `reward`;
- an episode runs at most `max_turns` model turns, and a turn starts only while the episode's
  response has room for a whole turn (`rollout.max_new_tokens`) within `tokens`: an episode that
  would overrun ends before that turn, or before an observation that would not fit, and counts
  as truncated (never cut in the middle of a turn or an observation); so does one that is never
  done within `max_turns`;
- an environment's or tool's failure ends its episode or becomes its observation, as
  engine/agents/env.py and engine/agents/tools.py say, counted in the metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from engine.agents.env import Step, as_step, call_all
from engine.agents.tools import PARSERS, Tool, ToolResult, run_call
from engine.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger("rlflow.agents")


@dataclass
class Episode:
    prompt: Any  # engine.data.prompts.Prompt
    ids: list[int] = field(default_factory=list)  # the response: sampled turns and observations
    mask: list[float] = field(default_factory=list)  # 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 under observations
    rewards: list[float] = field(default_factory=list)  # a step's reward on its turn's last token, else 0
    messages: list[dict] = field(default_factory=list)  # the turns by role, for sample tables
    reward: float = 0.0  # the environment's, summed over steps
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    error: str = ""  # why the environment ended it, if it failed
    done: bool = False  # the environment said so
    truncated: bool = False  # ended by max_turns or the token budget instead
    env: Any = None

    @property
    def over(self) -> bool:
        return self.done or self.truncated or bool(self.error)

    @property
    def answer(self) -> str:
        """The last model turn's text: what a reward function scores."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class Renderer:
    """Observations as token ids: chat messages rendered by the tokenizer's template as they would
    follow an assistant turn (with the tools offered), then encoded once."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools or None
        self.base = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        self.head = tokenizer.apply_chat_template(self.base, tools=self.tools, tokenize=False)
        eos = tokenizer.eos_token or ""
        end = self.head.rfind(eos) if eos else -1
        self.after_eos = self.head[end + len(eos):] if end >= 0 else ""  # what the template puts after a turn's end

    def __call__(self, messages: list[dict], ended: bool) -> list[int]:
        """The ids of `messages` after a model turn that `ended` with eos (else eos comes first)."""
        full = self.tokenizer.apply_chat_template(self.base + messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self.head):
            raise ValueError("the chat template renders a conversation's start differently once more turns "
                             "follow; observations cannot be appended as ids")
        text = ("" if ended else self.tokenizer.eos_token or "") + self.after_eos + full[len(self.head):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def run_episodes(engine: RolloutEngine, tokenizer: Any, prompts: list, params: SamplingParams, env_class: Any,
                 max_turns: int, tokens: int, timeout_s: float, on_error: str) -> tuple[list[Episode], dict]:
    """`params.n` episodes per prompt, in order (a prompt's are contiguous), and their metrics."""
    start = time.perf_counter()
    episodes = [Episode(p) for p in prompts for _ in range(params.n)]
    tools: list[Tool] = list(getattr(env_class, "tools", []) or [])
    by_name = {t.name: t for t in tools}
    parse = PARSERS[getattr(env_class, "tool_parser", "hermes")]
    render = Renderer(tokenizer, [t.schema() for t in tools])
    stops = {tokenizer.eos_token_id, *params.stop_token_ids}
    env_s = 0.0
    made = call_all([partial(env_class, e.prompt) for e in episodes], timeout_s)
    for e, (ok, value) in zip(episodes, made):
        _settle(e, ok, value, on_error, "creating its environment")
        e.env = value if ok else None
    env_s += time.perf_counter() - start
    for turn in range(max_turns):
        running = [e for e in episodes if not e.over]
        for e in running:
            if len(e.ids) + params.max_new_tokens > tokens:
                e.truncated = True
        running = [e for e in running if not e.truncated]
        if not running:
            break
        if turn == 0:  # a prompt's samples share its prefill
            groups = engine.generate([p.ids for p in prompts], params)
            completions = dict(zip([id(e) for e in episodes], [c for g in groups for c in g]))
            turns = [completions[id(e)] for e in running]
        else:
            turns = [g[0] for g in engine.generate([e.prompt.ids + e.ids for e in running],
                                                   replace(params, n=1, seed=params.seed + turn))]
        acted: list[tuple[Episode, str, bool]] = []
        for e, c in zip(running, turns):
            e.ids += c.token_ids
            e.mask += [1.0] * len(c.token_ids)
            e.logprobs += c.logprobs
            e.rewards += [0.0] * len(c.token_ids)
            e.turns += 1
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": text})
            acted.append((e, text, bool(c.token_ids) and c.token_ids[-1] in stops))
        t0 = time.perf_counter()
        observations = _respond(acted, parse if tools else None, by_name, timeout_s, on_error)
        env_s += time.perf_counter() - t0
        for (e, _, ended), obs in zip(acted, observations):
            if e.over or obs is None:
                continue
            messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
            ids = render(messages, ended)
            if len(e.ids) + len(ids) + params.max_new_tokens > tokens or e.turns == max_turns:
                e.truncated = True
                continue
            e.ids += ids
            e.mask += [0.0] * len(ids)
            e.logprobs += [0.0] * len(ids)
            e.rewards += [0.0] * len(ids)
            e.messages += messages
    for e in episodes:
        if not e.over:
            e.truncated = True  # never done within max_turns
    n = len(episodes)
    metrics = {"episode/turns/mean": sum(e.turns for e in episodes) / n,
               "episode/tool_calls/mean": sum(e.tool_calls for e in episodes) / n,
               "episode/tool_errors": float(sum(e.tool_errors for e in episodes)),
               "episode/env_errors": float(sum(bool(e.error) for e in episodes)),
               "episode/truncated": float(sum(e.truncated for e in episodes)),
               "episode/reward/mean": sum(e.reward for e in episodes) / n,
               "episode/env_time_s": env_s, "episode/time_s": time.perf_counter() - start}
    failed = [e for e in episodes if e.error]
    if failed:
        log.warning("%d/%d episodes ended by an environment failure (reward 0); first: %s", len(failed), n,
                    failed[0].error)
    return episodes, metrics


def _settle(e: Episode, ok: bool, value: Any, on_error: str, what: str) -> None:
    """Record a failed environment call on its episode (reward 0), or raise under on_error=raise."""
    if ok:
        return
    reason = f"{what}: {type(value).__name__}: {value}"
    if on_error == "raise":
        raise RuntimeError(f"the environment failed {reason}") from value
    e.error, e.reward, e.rewards = reason, 0.0, [0.0] * len(e.rewards)


def _respond(acted: list[tuple[Any, str, bool]], parse: Any, tools: dict[str, Tool], timeout_s: float,
             on_error: str) -> list[str | list[dict] | None]:
    """Each turn's observation: its tool calls' results, or its environment's step (all at once)."""
    calls = [parse(text) if parse else [] for _, text, _ in acted]
    stepping = [i for i, c in enumerate(calls) if not c]
    stepped = call_all([partial(_step, acted[i][0].env, acted[i][1]) for i in stepping], timeout_s)
    calling = [(i, call) for i, c in enumerate(calls) for call in c]
    results = call_all([partial(run_call, call, tools) for _, call in calling], timeout_s)
    out: list[str | list[dict] | None] = [None] * len(acted)
    for i, (ok, value) in zip(stepping, stepped):
        e = acted[i][0]
        _settle(e, ok, value, on_error, f"at turn {e.turns}")
        if ok:
            step: Step = value
            e.reward += step.reward
            if e.rewards:  # on the turn's last token (before a turn had any, the reward stays in the total)
                e.rewards[-1] += step.reward
            e.done = step.done
            out[i] = None if step.done else step.observation
    for (i, call), (ok, value) in zip(calling, results):
        result = value if ok else ToolResult(call.name, f"error: {type(value).__name__}: {value}", True)
        e = acted[i][0]
        e.tool_calls += 1
        e.tool_errors += result.error
        messages = out[i]
        out[i] = (messages if isinstance(messages, list) else []) + [
            {"role": "tool", "name": result.name, "content": result.content}]
    return out


def _step(env: Any, text: str) -> Step:
    return as_step(env.step(text))

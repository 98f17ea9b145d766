"""Multi-turn episodes over any rollout engine, token in and token out.

Each turn, every running episode's whole token history (prompt, its sampled turns, its
observations) goes to the engine as the next prompt, as ids: nothing already in the history is
decoded and encoded again, so the ids the trainer trains on are exactly those the engine sampled.
A model turn is decoded once, to read its tool calls or hand it to the environment; an
observation is rendered by the chat template once and encoded once, then appended as ids. The
native engine keeps each history in its slot between turns (engine/rollout/native.py), so a turn
takes in only its new tokens.

Two loops: turn by turn (every running episode's turn in one `generate`, then all their calls at
once), or, with the environment class's `overlap` and the native engine, overlapped (an episode's
calls start when its own turn is sampled, and its next turn joins the engine's running batch
when they return, through `NativeRollout.serve`).

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
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from rlflow.engine.agents.env import Step, as_step, call_all
from rlflow.engine.agents.tools import PARSERS, Tool, ToolResult, run_call
from rlflow.engine.data.prompts import Renderer
from rlflow.engine.rollout.base import Completion, Request, RolloutEngine, SamplingParams

log = logging.getLogger("rlflow.agents")


@dataclass
class Episode:
    prompt: Any  # engine.data.prompts.Prompt
    ids: list[int] = field(default_factory=list)  # the response: sampled turns and observations
    mask: list[float] = field(default_factory=list)  # 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 under observations
    # the weights version per token, the last turn's under an observation ([] from an engine that books none)
    versions: list[int] = field(default_factory=list)
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


@dataclass
class _Turns:
    """What every turn of a call's episodes needs: the sampling, the budgets, the tools, the template."""
    tokenizer: Any
    params: SamplingParams
    max_turns: int
    tokens: int
    timeout_s: float
    on_error: str
    env_class: Any

    def __post_init__(self) -> None:
        tools: list[Tool] = list(getattr(self.env_class, "tools", []) or [])
        self.tools = {t.name: t for t in tools}
        self.parse = PARSERS[getattr(self.env_class, "tool_parser", "hermes")] if tools else None
        self.render = Renderer(self.tokenizer, [t.schema() for t in tools])
        self.stops = {self.tokenizer.eos_token_id, *self.params.stop_token_ids}

    def room(self, e: Episode) -> bool:
        """Whether `e` has room for a whole turn; if not, it ends truncated."""
        if len(e.ids) + self.params.max_new_tokens > self.tokens:
            e.truncated = True
        return not e.over

    def sampled(self, e: Episode, c: Completion) -> tuple[Episode, str, bool]:
        """Append a model turn to `e`: (e, its text, whether it ended with a stop token)."""
        e.ids += c.token_ids
        e.mask += [1.0] * len(c.token_ids)
        e.logprobs += c.logprobs
        e.versions += c.versions
        e.rewards += [0.0] * len(c.token_ids)
        e.turns += 1
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        return e, text, bool(c.token_ids) and c.token_ids[-1] in self.stops

    def respond(self, acted: list[tuple[Episode, str, bool]]) -> list[str | list[dict] | None]:
        return _respond(acted, self.parse, self.tools, self.timeout_s, self.on_error)

    def observe(self, e: Episode, obs: str | list[dict] | None, ended: bool) -> bool:
        """Append `obs` to `e` as ids; whether `e` goes on to another turn."""
        if e.over or obs is None:
            return False
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
        ids = self.render(messages, ended)
        if len(e.ids) + len(ids) + self.params.max_new_tokens > self.tokens or e.turns == self.max_turns:
            e.truncated = True
            return False
        e.ids += ids
        e.mask += [0.0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.versions += e.versions[-1:] * len(ids)
        e.rewards += [0.0] * len(ids)
        e.messages += messages
        return True


def run_episodes(engine: RolloutEngine, tokenizer: Any, prompts: list, params: SamplingParams, env_class: Any,
                 max_turns: int, tokens: int, timeout_s: float, on_error: str,
                 overlap: bool | None = None) -> tuple[list[Episode], dict]:
    """`params.n` episodes per prompt, in order (a prompt's are contiguous), and their metrics.
    With `overlap` (None: the environment class's `overlap` attribute, default False) and an engine
    that serves requests as they come (the native one), each episode's environment and tool calls
    run while the other episodes generate, so a slow call holds only its own episode; otherwise
    turn by turn, which is faster while calls take alike long (bench/episodes.py)."""
    start = time.perf_counter()
    episodes = [Episode(p) for p in prompts for _ in range(params.n)]
    turns = _Turns(tokenizer, params, max_turns, tokens, timeout_s, on_error, env_class)
    made = call_all([partial(env_class, e.prompt) for e in episodes], timeout_s)
    for e, (ok, value) in zip(episodes, made):
        _settle(e, ok, value, on_error, "creating its environment")
        e.env = value if ok else None
    env_s = time.perf_counter() - start
    if overlap is None:
        overlap = bool(getattr(env_class, "overlap", False))
    if overlap and engine.streams:
        env_s += _overlapped(engine, prompts, episodes, turns)
    else:
        env_s += _turn_by_turn(engine, prompts, episodes, turns)
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


def _turn_by_turn(engine: RolloutEngine, prompts: list, episodes: list[Episode], turns: _Turns) -> float:
    """Every running episode's turn in one `generate`, then all their calls at once, then the next
    turn (turn t samples with seed + t, so a seed gives the same episodes). Returns the seconds
    spent in calls."""
    params, env_s = turns.params, 0.0
    for turn in range(turns.max_turns):
        running = [e for e in episodes if turns.room(e)]
        if not running:
            break
        if turn == 0:  # a prompt's samples share its prefill
            groups = engine.generate([p.ids for p in prompts], params)
            completions = dict(zip([id(e) for e in episodes], [c for g in groups for c in g]))
            sampled = [completions[id(e)] for e in running]
        else:
            sampled = [g[0] for g in engine.generate([e.prompt.ids + e.ids for e in running],
                                                     replace(params, n=1, seed=params.seed + turn))]
        acted = [turns.sampled(e, c) for e, c in zip(running, sampled)]
        t0 = time.perf_counter()
        observations = turns.respond(acted)
        env_s += time.perf_counter() - t0
        for (e, _, ended), obs in zip(acted, observations):
            turns.observe(e, obs, ended)
    return env_s


def _overlapped(engine: Any, prompts: list, episodes: list[Episode], turns: _Turns) -> float:
    """The episodes through the engine's `serve`: a finished turn's calls start at once in a pool
    thread while the engine decodes the others, and its next turn joins the engine when they
    return. Samples then depend on when calls return. Returns the seconds the engine sat idle
    waiting for calls."""
    n = turns.params.n
    first: list[Request] = []
    for i, p in enumerate(prompts):  # a prompt's samples share its prefill
        keys = [e for e in episodes[i * n:(i + 1) * n] if turns.room(e)]
        if keys:
            first.append(Request(p.ids, keys))
    generating = sum(len(r.keys) for r in first)
    responding, waited, started = 0, 0.0, False
    answered: queue.SimpleQueue = queue.SimpleQueue()  # (episode, ended, observation, exception)

    def respond(e: Episode, text: str, ended: bool) -> None:
        try:
            answered.put((e, ended, turns.respond([(e, text, ended)])[0], None))
        except BaseException as exc:  # on_error=raise: re-raised in the engine's thread
            answered.put((e, ended, None, exc))

    def feed(finished: list[tuple[Any, Completion]], wait: bool) -> list[Request] | None:
        nonlocal generating, responding, waited, started
        if not started:
            started = True
            return first or None
        for e, c in finished:
            pool.submit(respond, *turns.sampled(e, c))
        generating -= len(finished)
        responding += len(finished)
        new: list[Request] = []
        while responding:
            block = wait and not new and not generating
            t0 = time.perf_counter()
            try:
                e, ended, obs, exc = answered.get(block=block)
            except queue.Empty:
                break
            waited += time.perf_counter() - t0 if block else 0.0
            responding -= 1
            if exc is not None:
                raise exc
            if turns.observe(e, obs, ended):
                new.append(Request(e.prompt.ids + e.ids, [e]))
        generating += len(new)
        return new if new or generating or responding else None

    pool = ThreadPoolExecutor(max_workers=len(episodes), thread_name_prefix="rlflow-episode")
    try:
        engine.serve(turns.params, feed)
    finally:
        pool.shutdown(wait=False)
    return waited


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

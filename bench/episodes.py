"""Multi-turn episodes with a slow tool: new tokens/s against an instant tool, side by side.

    python bench/episodes.py --shape qwen2.5-0.5b --episodes 256 --turns 4 --tool-ms 50

Random weights in the given shape (bench/shapes.py), bf16 on the GPU (fp32 on CPU), random
prompts, the native engine, and the real episode loop (engine/agents/episodes.py): each turn's
tool call is parsed, run, rendered by the chat template and appended as ids, and the next turn
continues the history in its slot. Random weights never write a call or an end token, so both
are forced: every turn ends at a length drawn per episode and turn from [--min-len, --max-len]
(a per-prompt limit) and calls the tool once. Two loops:
- overlapped (the native engine's): a turn's call starts as soon as the turn ends, while the
  other episodes decode, and the next turn joins the engine when it returns;
- turn-by-turn (hf's and vllm's): all episodes' turns, then all their calls at once, then the next.
Three tools:
- instant: returns at once;
- slow: sleeps --tool-ms a call, calls running at once;
- blocking (the control): sleeps as long, one call at a time, as if each ran in the engine's loop.
Each loop runs instant and slow for --repeats rounds after --warmup runs, each round on fresh prompts
(so no kept history helps); the control runs once, overlapped. Prints each one's new (sampled)
tokens/s, slow/instant per round and loop, and overlapped/turn-by-turn with the slow tool.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import threading
import time
from dataclasses import replace

import torch
from shapes import QWEN25, TINY, endless_model, sync  # bench/shapes.py: bench/ is sys.path[0] when a script runs

from rlflow.engine.agents.env import Step
from rlflow.engine.agents.episodes import run_episodes
from rlflow.engine.agents.tools import PARSERS, Tool, ToolCall
from rlflow.engine.data.prompts import Prompt
from rlflow.engine.rollout.base import Feed, SamplingParams
from rlflow.engine.rollout.model import NativeCausalLM
from rlflow.engine.rollout.native import NativeRollout

SHAPES = {**QWEN25, "tiny": TINY}
MODES = ("overlapped", "turn-by-turn")  # calls while the others generate (the native default), or between turns
PARSERS["every_turn"] = lambda text: [ToolCall("wait")]  # random weights never write a call: each turn makes one


class Drawn:
    """The engine, each prompt's turn ending at a length drawn from (its first tokens, its length):
    one draw per episode and turn, the same in every run."""

    def __init__(self, engine: NativeRollout, low: int, high: int) -> None:
        self.engine, self.low, self.high = engine, low, high
        self.streams = engine.streams

    def draw(self, prompt: list[int]) -> int:
        return random.Random(hash((tuple(prompt[:8]), len(prompt)))).randint(self.low, self.high)

    def generate(self, prompts: list[list[int]], params: SamplingParams):
        return self.engine.generate(prompts, replace(params, limits=[self.draw(p) for p in prompts]))

    def serve(self, params: SamplingParams, feed: Feed) -> None:
        def drawn(finished, wait):
            new = feed(finished, wait)
            return None if new is None else [replace(r, limit=self.draw(r.prompt)) for r in new]

        self.engine.serve(params, drawn)


def environment(seconds: float, one_at_a_time: bool, straggle: float = 1.0) -> type:
    """A tool that sleeps `seconds` a call (`straggle` times as long on every 16th call)."""
    lock = threading.Lock() if one_at_a_time else None
    calls = itertools.count()

    def wait() -> str:
        pause = seconds * (straggle if next(calls) % 16 == 0 else 1.0)
        if lock is None:
            time.sleep(pause)
        else:
            with lock:
                time.sleep(pause)
        return "ok"

    class Env:
        tools = [Tool("wait", "Wait.", {"type": "object", "properties": {}}, wait)]
        tool_parser = "every_turn"

        def __init__(self, prompt: Prompt) -> None:
            pass

        def step(self, response: str) -> Step:  # never reached: every turn calls the tool
            return Step(None, 0.0, True)

    return Env


def run(engine: Drawn, tok, env: type, args: argparse.Namespace, vocab: int, seed: int,
        overlap: bool = True) -> tuple[float, int, float]:
    """(seconds, sampled tokens, tool seconds) of one batch of episodes on fresh prompts."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [Prompt(ids, "bench", "", {}, "") for ids in
               torch.randint(100, vocab, (args.episodes, args.prompt), generator=gen).tolist()]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_len, seed=seed)
    sync()
    start = time.perf_counter()
    episodes, metrics = run_episodes(engine, tok, prompts, params, env, max_turns=args.turns,
                                     tokens=args.turns * (args.max_len + 16), timeout_s=60, on_error="raise",
                                     overlap=overlap)
    sync()
    seconds = time.perf_counter() - start
    assert all(e.turns == args.turns and e.tool_calls == args.turns for e in episodes), "every turn ran and called"
    return seconds, int(sum(sum(e.mask) for e in episodes)), metrics["episode/env_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--straggle", type=float, default=20.0,
                    help="the straggler tool's every 16th call is this much slower")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first: graph capture, compiled prefill shapes")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = endless_model(SHAPES[args.shape], device, dtype)  # every turn runs to its drawn length
    cfg = model.config
    native = NativeRollout(NativeCausalLM.from_module(model), tok, max_slots=args.episodes,
                           max_len=args.prompt + args.turns * (args.max_len + 16))
    engine = Drawn(native, args.min_len, args.max_len)
    tools = {"instant": environment(0.0, False), "slow": environment(args.tool_ms / 1e3, False),
             "straggler": environment(args.tool_ms / 1e3, False, args.straggle),
             "blocking": environment(args.tool_ms / 1e3, True)}
    print(f"{args.shape}, {args.episodes} episodes x {args.turns} turns of {args.min_len}-{args.max_len} tokens "
          f"after a {args.prompt}-token prompt, a {args.tool_ms:g} ms tool, {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)
    warm = [run(engine, tok, tools["instant"], args, cfg.vocab_size, seed=10_000 + i)[0] for i in range(args.warmup)]
    print(f"  warm-up runs: {', '.join(f'{s:.2f}' for s in warm)} s", flush=True)
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for mode in MODES:
            for k, name in enumerate(("instant", "slow", "straggler")):
                seconds, tokens, tool_s = run(engine, tok, tools[name], args, cfg.vocab_size,
                                              seed=3 * r + k, overlap=mode == "overlapped")
                rates.setdefault((mode, name), []).append(tokens / seconds)
                print(f"  round {r} {mode:12s} {name:8s} {seconds:6.2f} s  {tokens:7,d} tokens  "
                      f"{tokens / seconds:9,.0f} tok/s  (waited on tools {tool_s:.2f} s)", flush=True)
    seconds, tokens, tool_s = run(engine, tok, tools["blocking"], args, cfg.vocab_size, seed=99)
    blocking = tokens / seconds
    print(f"  control {'overlapped':12s} blocking {seconds:6.2f} s  {tokens:7,d} tokens  {blocking:9,.0f} tok/s  "
          f"(waited on tools {tool_s:.2f} s)")
    for (mode, name), values in rates.items():
        print(f"  {mode:12s} {name:8s} median {statistics.median(values):9,.0f} tok/s  (min {min(values):,.0f}, "
              f"max {max(values):,.0f})")
    for mode in MODES:
        for name in ("slow", "straggler"):
            ratios = [s / i for s, i in zip(rates[mode, name], rates[mode, "instant"])]
            print(f"  {mode:12s} {name} / instant: median {statistics.median(ratios):.3f} "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    for name in ("instant", "slow", "straggler"):
        ratios = [o / t for o, t in zip(rates["overlapped", name], rates["turn-by-turn", name])]
        print(f"  {name} tool, overlapped / turn-by-turn: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"  blocking / overlapped instant median: {blocking / statistics.median(rates['overlapped', 'instant']):.3f}")


if __name__ == "__main__":
    main()

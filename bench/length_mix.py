"""The length mix of `bench/e2e.py`: prompts of many lengths, and answers that end at drawn lengths,
the same in rlflow and TRL.

A random-weight model almost never samples its end token, so each answer's end is drawn and forced:
answer j of a prompt (its j-th sample) has `answer_length(mix, prompt ids, j)` tokens, a draw that
depends on nothing else, so both frameworks get the same lengths for the same prompts whatever
order they run them in.
- TRL: `ForceEnd`, a logits processor handed to its `generate`, makes the end token the only choice
  at an answer's last position (the answer ends with it, "stop", as a real one does).
- rlflow: its native engine gives each sequence that length as its limit (it ends there,
  "length"). The job's processes (the driver and every Ray worker) load the patch at start from a
  `sitecustomize` module that `hook_dir` writes, put first on PYTHONPATH; it patches the engine's
  module when that is imported, and touches nothing else.
Both frameworks can still sample the end token earlier by chance (about one draw in the vocabulary
size); the bench checks the lengths each one logged against the draws.

Lengths are log-normal, clipped to a floor and the cap: prompts with a median of 0.4 x the cap
(meant as a GSM8K question in a short instruction: at `--prompt-len 256`, a median of 102 tokens
and nine in ten between 50 and 250), answers with a median of 0.45 x the cap (about one in twenty
reaches it, so the longest answer holds a step, as it does in real GRPO batches). The `reasoning`
mix (`reasoning_mix`) draws reasoning RL's answers: a median near 500 tokens, a longer tail.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import json
import math
import os
import random
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV = "RLFLOW_BENCH_LENGTH_MIX"  # the mix, as JSON, for the job's processes
PATCHED = "rlflow.engine.rollout.scheduler"


@dataclass(frozen=True)
class Mix:
    seed: int
    new: int  # the cap of answer lengths: rollout.max_new_tokens, TRL's max_completion_length
    median: float = 0.45  # of answer lengths, as a share of the cap
    sigma: float = 0.5


REASONING_MEDIAN = 500  # tokens: the median answer of reasoning RL's long-tailed lengths


def reasoning_mix(seed: int, new: int) -> Mix:
    """Reasoning RL's answers: a median near REASONING_MEDIAN tokens and a long tail (sigma 0.8: at a
    cap of 2,048 about one answer in twenty-five reaches it)."""
    return Mix(seed, new, median=min(0.45, REASONING_MEDIAN / new), sigma=0.8)


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(math.exp(rng.gauss(math.log(median), sigma)))))


def prompt_lengths(count: int, cap: int, seed: int, low: int = 16) -> list[int]:
    rng = random.Random(f"prompts:{seed}")
    return [lognormal(rng, 0.4 * cap, 0.5, min(low, cap), cap) for _ in range(count)]


def answer_length(mix: Mix, prompt: list[int], j: int) -> int:
    """The drawn length of sample `j` of `prompt` (token ids), from nothing else."""
    key = zlib.crc32(",".join(map(str, prompt)).encode())
    return lognormal(random.Random(f"answer:{mix.seed}:{key}:{j}"), mix.median * mix.new, mix.sigma, 1, mix.new)


def mean_answer(mix: Mix, prompts: list[list[int]], samples: int) -> float:
    return sum(answer_length(mix, p, j) for p in prompts for j in range(samples)) / (len(prompts) * samples)


# -- TRL: a logits processor -----------------------------------------------------------------------

def samples_of(prompts: list[list[int]]) -> list[int]:
    """Each row's sample index: how many rows before it hold the same prompt."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for p in prompts:
        out.append(seen.get(tuple(p), 0))
        seen[tuple(p)] = out[-1] + 1
    return out


class ForceEnd:
    """A transformers logits processor: row r's answer ends with `eos` as its `ends[r]`-th token."""

    def __init__(self, ends: Any, eos: int, start: int) -> None:
        self.ends, self.eos, self.start = ends, eos, start  # ends: a tensor on the logits' device

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        last = self.ends - 1 == input_ids.shape[1] - self.start  # rows whose next token is their last
        if bool(last.any()):
            scores[last] = float("-inf")
            scores[last, self.eos] = 0.0
        return scores


def force_ends(model: Any, mix: Mix, eos: int, pad: int) -> list[int]:
    """Wrap `model.generate` so that every call forces each answer's drawn end; returns a list that
    counts the calls (one entry each: the call's rows), for the caller to check it was used."""
    import torch
    from transformers import LogitsProcessorList

    generate, calls = model.generate, []

    def drawn(*args: Any, **kwargs: Any) -> Any:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        if any(t == pad for p in prompts for t in p):
            raise RuntimeError("a prompt holds the pad token: the mask would not recover it")
        ends = torch.tensor([answer_length(mix, p, j) for p, j in zip(prompts, samples_of(prompts))],
                            device=ids.device)
        calls.append(len(prompts))
        return generate(*args, **kwargs, logits_processor=LogitsProcessorList([ForceEnd(ends, eos, ids.shape[1])]))

    model.generate = drawn
    return calls


# -- rlflow: a patch of the native engine's scheduler in every process of the job -------------------------------

def patch_native(module: Any, mix: Mix) -> None:
    """Sequences keyed (prompt index, sample) get their drawn length as their limit. The one patch
    of the bench: it checks the engine's sequence record still has the field it sets, and the
    bench checks the lengths the job logged."""
    base = module.Seq
    if "limit" not in {f.name for f in dataclasses.fields(base)}:
        raise RuntimeError(f"{module.__name__}.Seq has no `limit` any more: the length mix cannot end its sequences")

    class Drawn(base):  # type: ignore[misc, valid-type]
        def __init__(self, prompt: list[int], key: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(prompt, key, *args, **kwargs)
            if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int):
                self.limit = min(self.limit, answer_length(mix, prompt, key[1]))

    module.Seq = Drawn


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` has been imported (its code run), in this process."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def install_from_env() -> None:
    """sitecustomize's call: patch the engine when it is imported, if the job was given a mix."""
    spec = os.environ.get(ENV)
    if spec and PATCHED not in sys.modules:
        mix = Mix(**json.loads(spec))
        sys.meta_path.insert(0, _AfterImport(PATCHED, lambda module: patch_native(module, mix)))


def hook_dir(root: Path, mix: Mix) -> tuple[Path, dict[str, str]]:
    """A directory holding a `sitecustomize` that installs the patch, and the environment to give
    the job: that directory first on PYTHONPATH, the mix in `ENV`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('length_mix', {str(Path(__file__).resolve())!r})\n"
        "module = sys.modules['length_mix'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.install_from_env()\n")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return root, {"PYTHONPATH": path, ENV: json.dumps(asdict(mix))}

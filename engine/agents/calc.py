"""The embedded agent task: 3-digit multiplication with a calculator.

The embedded model (about 0.8M parameters) cannot multiply two 3-digit numbers, but it can learn
to ask: the episode is the problem ("417*382="), a call in the compact form (`<<calc:417*382>>`), the tool's result
(`[159294]`, an observation: not trained on) and the answer copied from it. The environment scores
the answer exactly. With the embedded model and tokenizer (engine/data/task.py, whose chat
template names the offered tools and brackets a tool's result), `rollout.env=rlflow.engine.agents.calc:Calculator`
makes `embedded` data this task: train and validation problems (disjoint) and 256
demonstrations on training problems, which the warm start learns from. The demonstrations are a
careless demonstrator's: each calls the tool right, but three in four copy its result with one
digit wrong or off by one. The warm-started policy has the episode's form and copies right less
than half the time; RL, rewarded for the exact product, learns to copy.

Invariants:
- train and validation problems are disjoint, and the same seed writes the same rows;
- a demonstration is an episode as the rollout holds it: the call, the tool's result, the answer.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlflow.engine.agents.env import Step
from rlflow.engine.agents.tools import CALCULATOR
from rlflow.engine.data import task

DATA_SOURCE = "calc"
ENV = "rlflow.engine.agents.calc:Calculator"
DEMOS = 256


class Calculator:
    """Scores an answer turn exactly against the product; the model calls the calculator first."""

    tools = [CALCULATOR]
    tool_parser = "compact"

    def __init__(self, prompt) -> None:
        self.truth = prompt.ground_truth

    def step(self, response: str) -> Step:
        return Step(None, float(response.strip() == self.truth), True)


def _row(a: int, b: int, index: int, split: str) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": index, "split": split}}


def demonstration(a: int, b: int, slip: random.Random | None = None) -> list[dict]:
    """The episode a policy should play on a*b, as chat turns after the prompt; with `slip`, the
    answer copies the tool's result with one digit wrong, as a careless demonstrator would."""
    answer = task.wrong_answer(a * b, slip) if slip else str(a * b)
    return [{"role": "assistant", "content": f"<<calc:{a}*{b}>>"}, {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": answer}]


def build_data(out_dir: str | Path, n_train: int = 4096, n_val: int = 256, n_demos: int = DEMOS,
               seed: int = 0) -> dict[str, str]:
    """Write train/val prompt rows and demonstration rows (`prompt` and `response` turns) as parquet;
    returns {"train", "val", "demos"} paths."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < n_train + n_val:
        pair = (rng.randrange(100, 1000), rng.randrange(100, 1000))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    val, train = pairs[:n_val], pairs[n_val:]
    demos = [{**_row(a, b, i, "train"), "response": demonstration(a, b, rng if i % 4 else None)}
             for i, (a, b) in enumerate(train[:n_demos])]
    rows = {"train": [_row(a, b, i, "train") for i, (a, b) in enumerate(train)],
            "val": [_row(a, b, i, "val") for i, (a, b) in enumerate(val)], "demos": demos}
    return task.write_splits(out_dir, rows)


def embedded_files(root: str | Path, seed: int) -> dict[str, str]:
    """This task's {"train", "val", "demos"} under ``root/calc``, built if missing."""
    out = Path(root) / "calc"
    paths = {split: str(out / f"{split}.parquet") for split in ("train", "val", "demos")}
    if all(Path(p).is_file() for p in paths.values()):
        return paths
    return build_data(out, seed=seed)

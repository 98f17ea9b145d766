"""The TRL side of bench/e2e.py, in a process of its own (separate CUDA state and peak memory):
`GRPOTrainer` on the spec that bench/e2e.py writes, each step and each generation timed, the
result written as JSON. On the length mix, its `generate` forces each answer's drawn end
(bench/length_mix.py).

    python bench/e2e_trl.py SPEC.json   # bench/e2e.py runs it; SPEC holds the model, data and GRPOConfig
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from e2e_reward import trl_reward
from length_mix import Mix, force_ends
from shapes import sync  # bench/ is sys.path[0] when a script here runs
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def main(spec_path: str) -> None:
    """Train as the spec at `spec_path` says, time each step and generation, write the result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    mix = spec["mix"] and Mix(**spec["mix"])
    gens: list[dict[str, float]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer, with `_generate` timed (TRL's own profiling timers only report to
        wandb/mlflow/trackio) and its prompt and completion lengths recorded."""

        def _generate(self, prompts: list) -> tuple:
            sync()
            start = time.perf_counter()
            out = super()._generate(prompts)
            sync()
            prompt_ids, completion_ids = out[0], out[1]
            lengths = {"prompt": {len(p) for p in prompt_ids}, "completion": {len(c) for c in completion_ids}}
            if not mix and any(len(v) != 1 for v in lengths.values()):
                raise RuntimeError(f"TRL generated uneven lengths: {lengths}")
            gens.append({"gen_s": time.perf_counter() - start, "n": len(completion_ids),
                         "prompt_len": sum(map(len, prompt_ids)) / len(prompt_ids),
                         "completion_len": sum(map(len, completion_ids)) / len(completion_ids),
                         "tokens": sum(map(len, prompt_ids)) + sum(map(len, completion_ids))})
            return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            sync()
            self.seconds.append(time.perf_counter() - self.start)

    texts = [json.loads(line)["prompt"] for line in Path(spec["train"]).read_text().splitlines()]
    timer = StepTimer()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    trainer = TimedGRPOTrainer(model=spec["model"], reward_funcs=[trl_reward], args=GRPOConfig(**spec["kwargs"]),
                               train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tok,
                               callbacks=[timer])
    forced = force_ends(trainer.model, mix, tok.eos_token_id, tok.pad_token_id) if mix else None
    trainer.train()
    if forced is not None and len(forced) != len(gens):
        raise SystemExit(f"the forced ends were applied in {len(forced)} of {len(gens)} generations")
    if len(gens) != len(timer.seconds):
        raise SystemExit(f"TRL generated {len(gens)} times in {len(timer.seconds)} optimizer steps; expected one each")
    steps = [dict(g, step_s=s) for g, s in zip(gens, timer.seconds)]
    alloc = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    Path(spec["result"]).write_text(json.dumps({"steps": steps, "alloc_gib": alloc}))


if __name__ == "__main__":
    main(sys.argv[1])

"""What a run of the embedded task gets right: greedy accuracy of its warm-started and final models
on the training and held-out problems, split by the sum's number of digits and by whether the
ones carry.

    python docs/arith_breakdown.py outputs/rlflow            # a run's trainer.output_dir
    python docs/arith_breakdown.py run1/outputs/rlflow run2/outputs/rlflow

Reads `<dir>/warmstart` and `<dir>/hf_model` (HF directories) and `<dir>/embedded/data`; answers
are greedy, at most 6 new tokens, scored as the run scores them (`engine.data.task.compute_score`),
so a held-out figure equals the run's `val/greedy_score` at that model. The embedded chat template
passes a user message through as it is, so the prompt is the problem's text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlflow.engine.data.task import compute_score
from rlflow.engine.tensors import left_pad


def group(problem: str) -> str:
    a, b = (int(x) for x in problem.rstrip("=").split("+"))
    digits = "3-digit sum" if a + b >= 100 else "2-digit sum"
    return f"{digits}, {'carry' if a % 10 + b % 10 >= 10 else 'no carry'}"


@torch.no_grad()
def greedy(model: torch.nn.Module, tok: AutoTokenizer, problems: list[str]) -> list[str]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows, mask = left_pad([tok.encode(p) for p in problems], pad)
    out = model.generate(input_ids=rows, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=pad, eos_token_id=tok.eos_token_id)
    return [tok.decode(r[rows.shape[1]:], skip_special_tokens=True) for r in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path, help="trainer.output_dir of embedded-task runs")
    args = ap.parse_args()
    for root in args.dirs:
        for name in ("warmstart", "hf_model"):
            print(f"{root}/{name}")
            model = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(root / name)
            for split in ("train", "val"):
                df = pd.read_parquet(root / "embedded" / "data" / f"{split}.parquet")
                problems = [r.prompt[0]["content"] for r in df.itertuples()]
                truths = [r.reward_model["ground_truth"] for r in df.itertuples()]
                right = [compute_score("", a, t) for a, t in zip(greedy(model, tok, problems), truths)]
                by: dict[str, list[float]] = {}
                for p, r in zip(problems, right):
                    by.setdefault(group(p), []).append(r)
                print(f"  {split:5} {100 * sum(right) / len(right):5.1f}%   "
                      + "   ".join(f"{k} {100 * sum(v) / len(v):3.0f}% (of {len(v)})" for k, v in sorted(by.items())))


if __name__ == "__main__":
    main()

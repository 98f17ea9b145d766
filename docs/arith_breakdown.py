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

from engine.data.task import compute_score


def group(problem: str) -> str:
    a, b = (int(x) for x in problem.rstrip("=").split("+"))
    digits = "3-digit sum" if a + b >= 100 else "2-digit sum"
    return f"{digits}, {'carry' if a % 10 + b % 10 >= 10 else 'no carry'}"


@torch.no_grad()
def greedy(model_dir: Path, problems: list[str]) -> list[str]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = [tok.encode(p) for p in problems]
    width = max(map(len, ids))
    rows = torch.tensor([[pad] * (width - len(s)) + s for s in ids])  # left-padded
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
    out = model.generate(input_ids=rows, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=pad, eos_token_id=tok.eos_token_id)
    return [tok.decode(r[width:], skip_special_tokens=True) for r in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path, help="trainer.output_dir of embedded-task runs")
    args = ap.parse_args()
    for root in args.dirs:
        for model in ("warmstart", "hf_model"):
            print(f"{root}/{model}")
            for split in ("train", "val"):
                df = pd.read_parquet(root / "embedded" / "data" / f"{split}.parquet")
                problems = [r.prompt[0]["content"] for r in df.itertuples()]
                truths = [r.reward_model["ground_truth"] for r in df.itertuples()]
                right = [compute_score("", a, t) for a, t in zip(greedy(root / model, problems), truths)]
                by: dict[str, list[float]] = {}
                for p, r in zip(problems, right):
                    by.setdefault(group(p), []).append(r)
                print(f"  {split:5} {100 * sum(right) / len(right):5.1f}%   "
                      + "   ".join(f"{k} {100 * sum(v) / len(v):3.0f}% (of {len(v)})" for k, v in sorted(by.items())))


if __name__ == "__main__":
    main()

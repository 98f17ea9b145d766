"""A GSM8K-shaped GRPO run without GSM8K: a random-weight model of a Qwen2.5 shape with a
51-token character vocabulary, and word-problem rows whose prompts spread from 14 to 900 tokens.

    python bench/gsm8k_like.py --out /tmp/gsm8k_like                    # qwen2.5-0.5b shape, GPU
    python bench/gsm8k_like.py --out /tmp/gsm8k_like --shape tiny       # a CPU smoke run
    rlflow train gsm8k $(cat /tmp/gsm8k_like/args)                      # the printed command

It writes OUT/model (a HF directory: bf16 safetensors, config, tokenizer), OUT/train.parquet and
OUT/val.parquet (verl-shaped rows, data_source "openai/gsm8k", a number as ground truth) and
OUT/args, the settings that point the `gsm8k` recipe at them. The vocabulary is small on
purpose: a random model samples its end-of-text token about once in 51 draws, so answers end at
different lengths (a geometric spread, tens of tokens on average, capped by
rollout.max_new_tokens) the way a real model's do, and a step's length mix is a real one's. The
reward is GSM8K's rule scorer; a random model scores 0, so this measures speed and robustness,
not learning. Prompt lengths are drawn log-normally (median about 180 tokens), then clipped.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from shapes import QWEN25, TINY  # bench/ is sys.path[0] when run as a script

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz .,?+-*/=#$%"  # 48, plus pad, eos and unk: 51 tokens
WORDS = ("she", "he", "buys", "sells", "has", "gives", "each", "more", "than", "apples", "books", "cents",
         "boxes", "every", "day", "week", "how", "many", "does", "left", "after", "twice", "half", "of",
         "the", "a", "and", "in", "total", "costs", "$", "pays", "for")


def prompt_text(rng: random.Random, length: int) -> tuple[str, int]:
    """A word problem of exactly `length` characters (one token each) ending in a question, and its
    answer."""
    numbers = [rng.randint(2, 99) for _ in range(3)]
    question = " how many in total?"
    body: list[str] = []
    while len(" ".join(body)) < length - len(question):
        body.append(str(numbers[len(body) % 3]) if rng.random() < 0.15 else rng.choice(WORDS))
    text = (" ".join(body))[:length - len(question)].rstrip() + question
    return text.rjust(length, " ")[:length], sum(numbers)


def rows(count: int, rng: random.Random, low: int, high: int, split: str) -> list[dict]:
    out = []
    for i in range(count):
        length = min(high, max(low, round(math.exp(rng.gauss(math.log(180), 0.8)))))
        text, answer = prompt_text(rng, length)
        out.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": text}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": {"index": i, "split": split}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=[*QWEN25, "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--train", type=int, default=4096, help="training rows")
    ap.add_argument("--val", type=int, default=128, help="validation rows")
    ap.add_argument("--prompt", type=int, nargs=2, default=(14, 900), metavar=("MIN", "MAX"),
                    help="prompt tokens, clipped to this range")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from rlflow.engine.data.task import build_tokenizer

    tok = build_tokenizer(CHARS)
    shape = {**(TINY if args.shape == "tiny" else QWEN25[args.shape]), "vocab_size": len(tok)}
    cfg = Qwen2Config(**shape, max_position_embeddings=8192, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(args.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(args.out / "model")
    tok.save_pretrained(args.out / "model")

    rng = random.Random(args.seed)
    for split, count in (("train", args.train), ("val", args.val)):
        pd.DataFrame(rows(count, rng, *args.prompt, split)).to_parquet(args.out / f"{split}.parquet")
    settings = [f"model.path={args.out / 'model'}", f"data.train_files={args.out / 'train.parquet'}",
                f"data.val_files={args.out / 'val.parquet'}"]
    (args.out / "args").write_text(" ".join(settings) + "\n")
    print(f"wrote {args.out}: a {args.shape}-shape model with {len(tok)} tokens, {args.train} + {args.val} rows")
    print("rlflow train gsm8k " + " ".join(settings))


if __name__ == "__main__":
    main()

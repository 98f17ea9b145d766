"""The embedded default: a ~1M-parameter Qwen2 model and an exactly-checked addition task.

Everything here is built locally (no downloads) and written to disk in the same formats a user
brings: a HF model directory (safetensors + config + tokenizer) and parquet rows shaped like
verl's (`prompt` as chat messages, `data_source`, `reward_model.ground_truth`, `extra_info`).
The pipeline then loads them by path, exactly as it would a user's model and data.

Invariants:
- train and validation problems are disjoint (held-out accuracy is really held out);
- preference pairs (`build_pairs`) cover the same problems in the same order as the prompts, the
  chosen answer being the ground truth and the rejected one a near miss, never equal to it;
- the same seed gives the same files, byte for byte in content;
- the tokenizer is character-level over printable ASCII, so any prompt round-trips exactly.

Run: `python -m rlflow.engine.data.task OUT_DIR` writes `OUT_DIR/model` and `OUT_DIR/data/*.parquet`.
"""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path
from typing import Any

DATA_SOURCE = "arith"
PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
# User (and system) contents concatenated: the prompt itself ends in "=", which cues the answer.
# An assistant turn ends with eos, a tool's result comes in brackets, and offered tools are named
# in angle brackets first (the embedded agent task: engine/agents/calc.py).
CHAT_TEMPLATE = ("{% for tool in tools or [] %}<{{ tool['function']['name'] }}>{% endfor %}"
                 "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ message['content'] }}"
                 "<|endoftext|>{% elif message['role'] == 'tool' %}[{{ message['content'] }}]"
                 "{% else %}{{ message['content'] }}{% endif %}{% endfor %}")


def build_tokenizer(chars: str | None = None):
    """A character-level fast tokenizer over `chars` (default: printable ASCII), with pad/eos/unk specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chars is None:
        chars = "".join(sorted(set(string.printable) - set("\t\n\r\x0b\x0c")))
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(out_dir: str | Path, seed: int = 0, hidden: int = 128, layers: int = 4,
                chars: str | None = None, tokenizer: Any = None) -> Path:
    """Write a fresh Qwen2-architecture model + tokenizer (`tokenizer`, or the character-level one
    over `chars`) as a HF directory; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    out = Path(out_dir)
    tok = tokenizer or build_tokenizer(chars)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def problem(a: int, b: int, digits: int, pad: bool = True) -> tuple[str, str]:
    """The prompt and answer of `a + b`; with `pad`, zero-padded to a fixed width (`07+45=` -> `052`).
    Padded, each digit of a kind has one position, so a small model learns one rule for the ones digit
    rather than one per answer length (unpadded, a warm start can learn it for 3-digit sums only,
    and RL does not then learn it for 2-digit ones: docs/learning.md)."""
    if not pad:
        return f"{a}+{b}=", str(a + b)
    return f"{a:0{digits}d}+{b:0{digits}d}=", f"{a + b:0{digits + 1}d}"


def _row(prompt: str, answer: str, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split},
    }


def _problems(digits: int, n_train: int, n_val: int, seed: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint {"val", "train"} lists of (a, b) problems, in a seeded order."""
    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    random.Random(seed).shuffle(pairs)
    if n_train + n_val > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct {digits}-digit problems exist")
    return {"val": pairs[:n_val], "train": pairs[n_val:n_val + n_train]}


def write_splits(out_dir: str | Path, rows: dict[str, list[dict]]) -> dict[str, str]:
    """Each split's rows as `out_dir/<split>.parquet`; returns {split: path}."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: str(out / f"{split}.parquet") for split in rows}
    for split, items in rows.items():
        pd.DataFrame(items).to_parquet(paths[split])
    return paths


def build_data(out_dir: str | Path, digits: int = 2, n_train: int = 4096, n_val: int = 256,
               seed: int = 0, pad: bool = True) -> dict[str, str]:
    """Write train/val parquet files of `digits`-digit addition (`problem`); returns {split: path}."""
    splits = _problems(digits, n_train, n_val, seed)
    return write_splits(out_dir, {split: [_row(*problem(a, b, digits, pad), i, split) for i, (a, b) in enumerate(items)]
                                  for split, items in splits.items()})


def wrong_answer(answer: int, rng: random.Random, width: int = 0) -> str:
    """A near miss of `answer`, zero-padded to `width`: off by one, or one digit changed (never a new
    leading zero unless padded)."""
    text = f"{answer:0{width}d}"
    if rng.random() < 0.5:
        return f"{answer + 1 if answer == 0 or rng.random() < 0.5 else answer - 1:0{width}d}"
    i = rng.randrange(len(text))
    digits = [d for d in "0123456789" if d != text[i] and not (d == "0" and i == 0 and len(text) > 1 and not width)]
    return text[:i] + rng.choice(digits) + text[i + 1:]


def build_pairs(out_dir: str | Path, digits: int = 2, n_train: int = 4096, n_val: int = 256,
                seed: int = 0, pad: bool = True) -> dict[str, str]:
    """Write train/val preference pairs over the problems `build_data` writes, in the same order:
    `prompt`, `chosen` (the sum), `rejected` (a `wrong_answer` of the same width), `data_source`.
    Returns {split: path}."""
    rng = random.Random(seed)

    def pair(a: int, b: int) -> dict:
        prompt, answer = problem(a, b, digits, pad)
        return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}], "chosen": answer,
                "rejected": wrong_answer(a + b, rng, len(answer) if pad else 0)}

    return write_splits(out_dir, {split: [pair(a, b) for a, b in items]
                                  for split, items in _problems(digits, n_train, n_val, seed).items()})


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response is exactly the answer (surrounding whitespace ignored), else 0.0."""
    return float(solution_str.strip() == str(ground_truth).strip())


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "embedded")
    print(build_model(root / "model"), build_data(root / "data"))

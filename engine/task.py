"""The embedded default: a ~1M-parameter Qwen2 model and an exactly-checked addition task.

Everything here is built locally (no downloads) and written to disk in the same formats a user
brings: a HF model directory (safetensors + config + tokenizer) and parquet rows shaped like
verl's (`prompt` as chat messages, `data_source`, `reward_model.ground_truth`, `extra_info`).
The pipeline then loads them by path, exactly as it would a user's model and data.

Invariants:
- train and validation problems are disjoint (held-out accuracy is really held out);
- the same seed gives the same files, byte for byte in content;
- the tokenizer is character-level over printable ASCII, so any prompt round-trips exactly.

Run: `python -m engine.task OUT_DIR` writes `OUT_DIR/model` and `OUT_DIR/data/*.parquet`.
"""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path

DATA_SOURCE = "arith"
PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
# Concatenate message contents; the prompt itself ends in "=", which cues the answer.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


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
                chars: str | None = None) -> Path:
    """Write a fresh Qwen2-architecture model + tokenizer (over `chars`) as a HF directory; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    out = Path(out_dir)
    tok = build_tokenizer(chars)
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


def _row(a: int, b: int, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": index, "split": split},
    }


def build_data(out_dir: str | Path, digits: int = 2, n_train: int = 4096, n_val: int = 256,
               seed: int = 0) -> dict[str, str]:
    """Write train/val parquet files of `digits`-digit addition; returns {split: path}."""
    import pandas as pd

    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    random.Random(seed).shuffle(pairs)
    if n_train + n_val > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct {digits}-digit problems exist")
    splits = {"val": pairs[:n_val], "train": pairs[n_val:n_val + n_train]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, items in splits.items():
        rows = [_row(a, b, i, split) for i, (a, b) in enumerate(items)]
        paths[split] = str(out / f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(paths[split])
    return paths


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response is exactly the answer (surrounding whitespace ignored), else 0.0."""
    return float(solution_str.strip() == str(ground_truth).strip())


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "embedded")
    print(build_model(root / "model"), build_data(root / "data"))

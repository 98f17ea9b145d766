"""bench/gsm8k_like.py writes what a GSM8K-shaped run needs: a model of 51 tokens and verl-shaped
rows whose prompts spread over the asked range, each scored by GSM8K's rule scorer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
from transformers import AutoConfig, AutoTokenizer

from rlflow.engine.data.rewards import gsm8k_score

ROOT = Path(__file__).resolve().parents[2]


def test_the_generator_writes_a_small_vocabulary_model_and_mixed_length_rows(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "gsm8k_like.py"), "--out", str(tmp_path), "--shape", "tiny",
           "--train", "300", "--val", "10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(tok) == AutoConfig.from_pretrained(tmp_path / "model").vocab_size == 51
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert len(train) == 300 and len(pd.read_parquet(tmp_path / "val.parquet")) == 10
    lengths = [len(tok(tok.apply_chat_template(list(p), tokenize=False))["input_ids"]) for p in train.prompt]
    assert min(lengths) >= 14 and max(lengths) <= 900 and max(lengths) - min(lengths) > 300
    row = train.iloc[0]
    assert gsm8k_score(row.data_source, f"#### {row.reward_model['ground_truth']}",
                       row.reward_model["ground_truth"]) == 1.0
    assert (tmp_path / "args").read_text().split() == proc.stdout.splitlines()[-1].split()[3:]

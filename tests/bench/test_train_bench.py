"""bench/train.py's CPU smoke run: rlflow's trainer packed, padded and with shared prompts (rows in
groups of one prompt), and the plain transformers loop, each stepped and timed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_bench_times_every_method_and_shared_prompts(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--seqs", "8", "--group", "4", "--prompt", "16", "32",
           "--response", "8", "24", "--budget", "256", "--repeats", "1", "--cache", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rates = dict(re.findall(r"^\s+(packed|padded|shared|hf)\s+[\d.]+ s/step\s+(\d+) tok/s", proc.stdout, re.M))
    assert set(rates) == {"packed", "padded", "shared", "hf"} and all(int(r) > 0 for r in rates.values()), proc.stdout
    assert "shared/packed" in proc.stdout and "packed/hf" in proc.stdout

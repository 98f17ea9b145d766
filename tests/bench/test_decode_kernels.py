"""bench/decode_kernels.py's CPU smoke run: the written-out attention and the eager sampler time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_kernels_smoke_run():
    cmd = [sys.executable, str(ROOT / "bench" / "decode_kernels.py"), "--shape", "tiny", "--rows", "8", "--cache", "64"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "written-out" in proc.stdout and " us" in proc.stdout and "eager" in proc.stdout, proc.stdout
    assert "failed" not in proc.stdout, proc.stdout

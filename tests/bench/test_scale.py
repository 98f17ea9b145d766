"""bench/scale.py's CPU smoke run: the real job on one CPU rank, read back from MLflow, with every
phase of the step split timed (the reference and old-logprob forwards included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scale_smoke_run_times_every_phase(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--shape", "tiny", "--gpus", "0", "--prompts", "4",
           "--samples", "2", "--prompt-len", "16", "--new", "8", "--steps", "3", "--warmup", "1",
           "--mini-batches", "2", "--work", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["job_exit"] == 0 and row["tok_s_gpu"] > 0
    assert all(row[f"{p}_s"] > 0 for p in ("gen", "ref", "old_log_prob", "update_actor", "reshard")), row
    assert row["step_s"] > row["gen_s"] + row["ref_s"] + row["old_log_prob_s"] + row["update_actor_s"]
    assert row["settings"]["actor.kl_loss_coef"] == 0.001 and row["settings"]["actor.mini_batch_prompts"] == 2
    assert "| CPU | 1 |" in proc.stdout

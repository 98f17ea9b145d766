import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_rlflow_data_converts_and_reports_counts(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "2 apples and 3 more?", "answer": "2+3=5\n#### 5"}, {"question": "no answer", "answer": "x"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = subprocess.run([str(BIN / "rlflow"), "data", "gsm8k", str(src), str(tmp_path / "out.parquet")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 of 2 rows" in proc.stdout and "skipped=1" in proc.stdout
    bad = subprocess.run([str(BIN / "rlflow"), "data", "gsm8k", str(tmp_path / "missing.jsonl"),
                          str(tmp_path / "o.parquet")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr


def test_config_errors_exit_2_with_the_closest_key(tmp_path):
    proc = subprocess.run([str(BIN / "rlflow"), "config", "trainer.total_step=3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "trainer.total_steps" in proc.stderr

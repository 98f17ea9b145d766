"""bench/compare_runs.py tells two runs that logged the same numbers from two that did not,
whatever their timings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]


def logged(uri: str, loss: list[float]) -> str:
    """A run in the store at `uri`, through a client of its own: setting the process's tracking URI
    would outlive this test and redirect later tests' registry lookups."""
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("compare"))
    for step, value in enumerate(loss):
        client.log_metric(run.info.run_id, "actor/pg_loss", value, step=step)
        client.log_metric(run.info.run_id, "timing_s/step", 0.1 * step + len(uri), step=step)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def compare(*uris: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "compare_runs.py"), *uris], capture_output=True,
                          text=True, timeout=120)


def test_equal_series_pass_and_a_changed_value_fails_with_its_step(tmp_path):
    a, b, c = (f"sqlite:///{tmp_path / name}.db" for name in "abc")
    logged(a, [0.5, 0.25, 0.125])
    logged(b, [0.5, 0.25, 0.125])
    logged(c, [0.5, 0.25, 0.126])
    same = compare(a, b)
    assert same.returncode == 0 and "1 shared series (3 points), 1 identical" in same.stdout, same.stdout + same.stderr
    moved = compare(a, c)
    assert moved.returncode == 1 and "differs: actor/pg_loss (first at step 2: 0.125 vs 0.126)" in moved.stdout

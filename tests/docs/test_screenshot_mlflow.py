"""The MLflow UI renders rlflow runs: a real `mlflow server`, two tracked runs, headless Chromium.

Runs docs/screenshot_mlflow.py's own functions, so the documented screenshot stays reproducible.
Skipped only where the `chromium` binary is missing (CI installs it).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rlflow.engine.tracking import Tracker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(shutil.which("chromium") is None, reason="needs the chromium binary"),
              pytest.mark.timeout(300)]


def load_script():
    spec = importlib.util.spec_from_file_location("screenshot_mlflow", ROOT / "docs" / "screenshot_mlflow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metric_page_draws_one_reward_curve_per_run(tmp_path: Path) -> None:
    shot = load_script()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_ids = []
    # no three points on a line: plotly merges collinear points
    for name, rewards in (("run-a", [0.1, 0.3, 0.2, 0.4, 0.35]), ("run-b", [0.05, 0.1, 0.3, 0.2, 0.25])):
        t = Tracker("compare", run_name=name, tracking_uri=uri, system_metrics=False)
        for step, reward in enumerate(rewards, 1):
            t.log_metrics({"critic/score/mean": reward}, step)
        t.finish()
        run_ids.append(t.run_id)
    experiment = MlflowClient(uri).get_experiment_by_name("compare").experiment_id
    with shot.mlflow_server(uri, str(tmp_path / "artifacts")) as url:
        page = shot.metric_page(url, experiment, run_ids, "critic/score/mean")
        dom = shot.chromium(page, "--dump-dom")
        shot.screenshot(page, str(tmp_path / "shot.png"))

    # the scripts ran and fetched the runs: a legend entry and each run's latest value per run
    assert "run-a (critic/score/mean)" in dom and "run-b (critic/score/mean)" in dom
    assert "0.35 (step=5)" in dom and "0.25 (step=5)" in dom
    # two distinct curves (plotly draws each line twice), five points each
    lines = set(re.findall(r'<path class="js-line" d="([^"]+)"', dom))
    assert len(lines) == 2 and all(line.count("L") == 4 for line in lines)
    png = (tmp_path / "shot.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000

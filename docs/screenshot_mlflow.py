"""Screenshot the MLflow UI comparing runs' reward curves (docs/img/mlflow_compare.png).

    python docs/screenshot_mlflow.py --tracking-uri sqlite:///mlflow.db --experiment compare \
        --out docs/img/mlflow_compare.png --crop-right 360

Starts `mlflow server` on 127.0.0.1 over the given store, opens the metric page of every run in
the experiment (one chart, one curve per run) in headless Chromium and saves the screenshot. Needs
the `chromium` binary (Debian: `apt-get install chromium`); no browser driver or Python package.
`tests/docs/test_screenshot_mlflow.py` runs the same functions against a fresh server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow import MlflowClient

# Without these, Chromium tries Google services at start-up and a closed network refuses it.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


@contextmanager
def mlflow_server(store_uri: str, artifacts: str) -> Iterator[str]:
    """`mlflow server` on a free loopback port for the duration of the block; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", store_uri, "--artifacts-destination", artifacts]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server on {url} did not come up")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server runs uvicorn as a child process
        proc.wait(timeout=20)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def metric_page(url: str, experiment_id: str, run_ids: list[str], metric: str) -> str:
    """The UI page plotting `metric` of `run_ids` against step, one curve per run."""
    query = {"runs": json.dumps(run_ids), "metric": json.dumps(metric), "experiments": json.dumps([experiment_id]),
             "plot_metric_keys": json.dumps([metric]), "x_axis": "step", "y_axis_scale": "linear",
             "line_smoothness": "1", "show_point": "true"}
    return f"{url}/#/metric?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


def chromium(url: str, *args: str, wait_ms: int = 15000) -> str:
    """Run headless Chromium on `url` with extra `args`; returns its stdout (the DOM for --dump-dom)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        # The virtual time budget lets the page's scripts fetch the runs and draw before the capture.
        cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}", *args, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def screenshot(url: str, out: str, size: str = "1400,800") -> None:
    chromium(url, f"--screenshot={os.path.abspath(out)}", f"--window-size={size}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tracking-uri", required=True, help="the runs' store, e.g. sqlite:///mlflow.db")
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--metric", default="critic/score/mean")
    ap.add_argument("--out", default="docs/img/mlflow_compare.png")
    ap.add_argument("--crop-right", type=int, default=0,
                    help="pixels cut off the right edge (MLflow 3 opens its assistant panel there)")
    args = ap.parse_args()
    client = MlflowClient(args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        sys.exit(f"no experiment named {args.experiment!r} in {args.tracking_uri}")
    runs = [r.info.run_id for r in client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])]
    with tempfile.TemporaryDirectory() as artifacts, mlflow_server(args.tracking_uri, artifacts) as url:
        screenshot(metric_page(url, experiment.experiment_id, runs, args.metric), args.out)
    if args.crop_right:
        from PIL import Image  # with matplotlib: pip install -e '.[docs]'

        image = Image.open(args.out)
        image.crop((0, 0, image.width - args.crop_right, image.height)).save(args.out)
    print(f"wrote {args.out}: {args.metric} of {len(runs)} runs")


if __name__ == "__main__":
    main()

"""Plot a run's held-out accuracy and training reward from the MLflow store.

    python docs/plot_run.py --tracking-uri sqlite:///mlflow.db --run-id RUN --out docs/img/learning.png
    python docs/plot_run.py ... --metric val/reward_margin --metric dpo/reward_margin --title "DPO"

With `--metric` (repeatable) it plots those metrics instead, annotating the first one.

Needs matplotlib (`pip install -e '.[docs]'`). The x axis is wall-clock minutes since the run
started, so the plot shows what the 10-minute budget buys.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow import MlflowClient  # noqa: E402


def series(client: MlflowClient, run_id: str, key: str, t0: int) -> tuple[list[float], list[float], list[int]]:
    hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
    return [(m.timestamp - t0) / 60000 for m in hist], [m.value for m in hist], [m.step for m in hist]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tracking-uri", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--metric", action="append", default=[], help="plot this metric instead (repeatable)")
    ap.add_argument("--title", default="rlflow train (embedded default): warm-start, then GRPO")
    args = ap.parse_args()
    client = MlflowClient(args.tracking_uri)
    t0 = client.get_run(args.run_id).info.start_time
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if args.metric:
        plot_metrics(client, args, ax, t0)
    else:
        plot_default(client, args, ax, t0)
    ax.set_xlabel("wall-clock minutes since the run started")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


def plot_metrics(client: MlflowClient, args: argparse.Namespace, ax: plt.Axes, t0: int) -> None:
    for key in args.metric:
        x, y, _ = series(client, args.run_id, key, t0)
        ax.plot(x, y, "o-" if key.startswith("val/") else "-", label=key, markersize=3,
                alpha=0.9 if key.startswith("val/") else 0.5)
    x, y, steps = series(client, args.run_id, args.metric[0], t0)
    if y:
        ax.annotate(f"end: {y[-1]:.3g} (step {steps[-1]})", (x[-1], y[-1]), textcoords="offset points",
                    xytext=(-90, 10))


def plot_default(client: MlflowClient, args: argparse.Namespace, ax: plt.Axes, t0: int) -> None:
    for key, label, style in (("val/greedy_score", "held-out greedy accuracy", "o-"),
                              ("critic/score/mean", "training reward (sampled)", "-"),
                              ("warmstart/loss", "warm-start loss (right axis)", None)):
        x, y, _ = series(client, args.run_id, key, t0)
        if style:
            ax.plot(x, y, style, label=label, markersize=3, alpha=0.9 if "held" in label else 0.5)
        elif x:
            twin = ax.twinx()
            twin.plot(x, y, color="gray", alpha=0.4, label=label)
            twin.set_ylabel("warm-start loss")
    x, y, steps = series(client, args.run_id, "val/greedy_score", t0)
    if y:
        ax.annotate(f"RL start: {y[0]:.0%}", (x[0], y[0]), textcoords="offset points", xytext=(5, 10))
        ax.annotate(f"end: {y[-1]:.0%} (step {steps[-1]})", (x[-1], y[-1]), textcoords="offset points",
                    xytext=(-90, 10))
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1)


if __name__ == "__main__":
    main()

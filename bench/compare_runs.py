"""Do two runs log the same numbers? Every metric series two MLflow runs share, compared value for
value and step for step; timings, throughput and system metrics (which no two runs share) apart.

    python bench/compare_runs.py sqlite:///a/mlflow.db sqlite:///b/mlflow.db   # each store's newest run
    python bench/compare_runs.py URI_A URI_B --runs RUN_A RUN_B

Exits 1 if a compared series differs. Used to show that a change moved no number: the same config,
seed and thread count, once on the commit before and once after (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys

from mlflow.tracking import MlflowClient

CLOCKS = ("timing_s/", "perf/", "system/")  # wall-clock and machine readings: never equal across runs ...
SECONDS = "time_s"  # ... and a series in seconds (an episode's `episode/env_time_s`)


def series(uri: str, run_id: str | None) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    client = MlflowClient(uri)
    if run_id is None:
        [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                   order_by=["attributes.start_time DESC"], max_results=1)
        run_id = run.info.run_id
    keys = client.get_run(run_id).data.metrics
    return run_id, {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k),
                                                          key=lambda m: (m.step, m.timestamp))]
                    for k in keys if not (k.startswith(CLOCKS) or k.endswith(SECONDS))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("uris", nargs=2, help="the two runs' tracking URIs")
    ap.add_argument("--runs", nargs=2, metavar=("RUN_A", "RUN_B"), help="run ids (default: each store's newest)")
    args = ap.parse_args()
    (id_a, a), (id_b, b) = (series(uri, run) for uri, run in zip(args.uris, args.runs or (None, None)))
    shared = sorted(set(a) & set(b))
    differ = [k for k in shared if a[k] != b[k]]
    print(f"runs {id_a} and {id_b}: {len(shared)} shared series ({sum(len(a[k]) for k in shared)} points), "
          f"{len(shared) - len(differ)} identical")
    for k in differ:
        first = next(i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y) if len(a[k]) == len(b[k]) else None
        where = f"first at step {a[k][first][0]}: {a[k][first][1]!r} vs {b[k][first][1]!r}" if first is not None \
            else f"{len(a[k])} vs {len(b[k])} points"
        print(f"  differs: {k} ({where})")
    for name, only in (("only in the first", set(a) - set(b)), ("only in the second", set(b) - set(a))):
        if only:
            print(f"{name}: {', '.join(sorted(only))}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

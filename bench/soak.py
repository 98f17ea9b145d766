"""A long run stays healthy: memory, speed and store size over a long GRPO run of the embedded default.

    python bench/soak.py                                  # 1,000 steps on the CPU
    python bench/soak.py --steps 60 --every 10 --base 10 warmstart.steps=200 warmstart.stop_accuracy=0   # a quick look

Runs the real job (`python -m rlflow.pipelines.cli train`, the embedded default on the CPU, with a
checkpoint every `--save-every` steps and validation every `--val-every`; further `key=value`
arguments go to it) in `--work`. Every `--every` steps, read from the run's MLflow store, it
samples the unique memory (USS: the pages only that process holds; RSS would count the Ray object
store's shared pages in every worker) of the driver and of every process under it (Ray's GCS,
raylet and agents, the stage workers, the compiled graph's proxy), and the size of the MLflow
store and of its artifacts. At the end it prints each sample, then each process's growth from
step `--base` to the last sample, and the mean step time of steps base..2*base against the last
`--base` steps; the targets are 10% for both.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.10


def current_step(db: Path) -> int:
    """The last step whose time the run has logged (-1 before the first)."""
    if not db.exists():
        return -1
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            row = c.execute("select max(step) from metrics where key = 'timing_s/step'").fetchone()
    except sqlite3.OperationalError:  # the store's tables are not made yet
        return -1
    return -1 if row[0] is None else int(row[0])


def step_times(db: Path) -> dict[int, float]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
        return dict(c.execute("select step, value from metrics where key = 'timing_s/step'").fetchall())


def label(p: psutil.Process, driver: int) -> str:
    if p.pid == driver:
        return "driver"
    words = p.cmdline() or [p.name()]
    # a Ray worker's title names the task it runs (ray::StageWorker.run): keep the class
    name = words[0].split(".")[0] if words[0].startswith("ray::") else Path(words[0]).name
    name = next((Path(w).name for w in words if w.endswith(".py")), name)  # Ray's Python daemons
    return f"{name}[{p.pid}]"


def unique_mib(driver: int) -> dict[str, float]:
    """USS in MiB of the driver and every process under it, by label."""
    found = {}
    try:
        tree = [psutil.Process(driver)] + psutil.Process(driver).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in tree:
        try:
            found[label(p, driver)] = p.memory_full_info().uss / 2**20
        except psutil.Error:  # exited while being read
            pass
    return found


def size_mib(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2**20
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="sample every this many steps")
    ap.add_argument("--base", type=int, default=100, help="growth and speed are measured from this step")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--work", type=Path, default=Path("soak"))
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    db, artifacts = args.work / "mlflow.db", args.work / "mlruns"  # a sqlite store's default artifact root
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db.resolve()}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", "train", f"trainer.total_steps={args.steps}",
           f"trainer.save_every={args.save_every}", f"trainer.val_every={args.val_every}",
           f"trainer.output_dir={(args.work / 'out').resolve()}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    samples: list[tuple[int, float, dict[str, float], float, float]] = []  # step, wall s, USS, db, artifacts
    start = time.time()
    with open(args.work / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=args.work, env=env, stdout=log, stderr=subprocess.STDOUT)
        due = args.every
        while proc.poll() is None:
            step = current_step(db)
            if step >= due:
                samples.append((step, time.time() - start, unique_mib(proc.pid), size_mib(db), size_mib(artifacts)))
                s = samples[-1]
                print(f"step {s[0]:5d}  {s[1]:7.0f} s  driver {s[2].get('driver', 0):7.1f} MiB  "
                      f"all {sum(s[2].values()):8.1f} MiB  "
                      f"store {s[3]:6.1f} MiB  artifacts {s[4]:6.1f} MiB", flush=True)
                due = (step // args.every + 1) * args.every
            time.sleep(0.5)
    if proc.returncode:
        raise SystemExit(f"the run failed ({proc.returncode}): see {args.work / 'log.txt'}")
    report(samples, step_times(db), args.base)


def report(samples: list, times: dict[int, float], base: int) -> None:
    first = next((s for s in samples if s[0] >= base), None)
    last = samples[-1] if samples else None
    if first is None or last is None or last[0] == first[0]:
        raise SystemExit(f"no two samples at or after step {base}")
    print(f"\nunique memory (MiB) from step {first[0]} to step {last[0]}:")
    worst = 0.0
    for name in sorted(first[2]):
        if name in last[2]:
            growth = last[2][name] / first[2][name] - 1
            worst = max(worst, growth)
            print(f"  {name:32s} {first[2][name]:8.1f} -> {last[2][name]:8.1f}  {growth:+6.1%}")
    print(f"  worst growth {worst:+.1%} (target at most {TARGET:.0%})")
    print(f"MLflow store {first[3]:.1f} -> {last[3]:.1f} MiB, artifacts {first[4]:.1f} -> {last[4]:.1f} MiB")
    end = max(times)
    window = lambda lo, hi: statistics.mean(v for k, v in times.items() if lo < k <= hi)  # noqa: E731
    early, late = window(base, 2 * base), window(end - base, end)
    print(f"step time: steps {base + 1}-{2 * base} {early:.3f} s, steps {end - base + 1}-{end} {late:.3f} s, "
          f"ratio {late / early:.3f} (target within {TARGET:.0%})")
    print("PASS" if worst <= TARGET and abs(late / early - 1) <= TARGET else "FAIL")


if __name__ == "__main__":
    main()

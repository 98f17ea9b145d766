"""Synchronous against asynchronous RL (one step off, and two steps queued ahead), on the CPU: the
real job (`rlflow train`, Ray, MLflow) from one warm start, several seeds, time to reach an accuracy.

    python bench/async.py                            # seeds 0-2, 30 steps each, ~20 min on 2 cores
    python bench/async.py --seeds 0 --steps 6        # a smoke run
    python bench/async.py --task agent               # the agent task, its tool 0.5 s a call

First the phase split of the embedded default (generation against the rest of a step), which
caps what any overlap can give. Then, per seed and side by side, with `rollout.backend=hf` (the
generation-heavier setup: the reference engine generates several times slower than the native
one, so generation and training take comparable time on the CPU):
  hybrid    the default placement, synchronous (one worker generates and trains)
  split     the rollout on a worker of its own, synchronous
  one_step  the same two workers, the rollout generating step t+1 while the trainer updates on t
            (`trainer.max_staleness=1`), with token-level truncated importance sampling for the
            version between them
  stream    the same, with the next two steps queued on the rollout pool (`trainer.max_staleness=2`):
            it never idles, and a batch is one or two versions old
  stale4, stale4_tis  four steps queued ahead, without and with the correction: a mismatch strong
            enough to see what the correction does (`--modes split,stale4,stale4_tis`)
With `--task agent`, the embedded agent task (conf/demo-agent.yaml) instead, warm-started as that
config does, on the native engine, its calculator taking `--tool-s` seconds a call
(bench/slow_calc.py, as a remote sandbox would): generation as long as the rest of a step, and
long enough that streaming (k = 2) takes pushed weights mid-batch (partial rollouts).
A run's clock is the sum of its logged step times (`timing_s/step`, validation left out). The
threshold is the smoothed held-out accuracy (a mean of two validations) that every synchronous
split run reaches; each run's time to it is printed, and the ideal overlap speedup
(gen + train) / max(gen, train) from the split runs' phases beside the asynchronous runs'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "hybrid": [],
    "split": ["placement.own_pool=[rollout]", "trainer.dag=plain"],
    "one_step": ["placement.own_pool=[rollout]", "trainer.dag=plain", "trainer.max_staleness=1",
                 "algorithm.rollout_correction=token_tis"],
    "stream": ["placement.own_pool=[rollout]", "trainer.dag=plain", "trainer.max_staleness=2",
               "algorithm.rollout_correction=token_tis"],
    # a stronger mismatch, with and without its correction (`--modes split,stale4,stale4_tis`)
    "stale4": ["placement.own_pool=[rollout]", "trainer.dag=plain", "trainer.max_staleness=4"],
    "stale4_tis": ["placement.own_pool=[rollout]", "trainer.dag=plain", "trainer.max_staleness=4",
                   "algorithm.rollout_correction=token_tis"],
}
# plain calls for the split runs: on 2 cores an idle compiled-graph actor spinning takes a core
# that generation or training needs (engine/config.py, placement.torch_threads)


def rlflow(work: Path, name: str, *overrides: str, conf: list[str] = (), tool_s: float = 0.0) -> str:
    """One `rlflow train [conf]` into the store under `work`; returns its run id."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db", "TOOL_S": str(tool_s)}
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", "train", *conf, f"trainer.output_dir={work / name}",
           f"trainer.run_name={name}", "trainer.log_checkpoint=false", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"attributes.run_name = '{name}'")
    return run.info.run_id


def curve(client: MlflowClient, run_id: str) -> dict:
    """Steps' clock and phases, and the held-out accuracy at each validation (over the steps' clock)."""
    def h(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}
    step, gen, acc, stale = h("timing_s/step"), h("timing_s/gen"), h("val/accuracy"), h("async/staleness/mean")
    clock, t = {0: 0.0}, 0.0
    for s in sorted(step):
        t += step[s]
        clock[s] = t
    steady = sorted(step)[1:-1]  # the first compiles and loads, the last has nothing to overlap
    return {"clock": clock, "accuracy": sorted(acc.items()),
            "step_s": statistics.median(step[s] for s in steady),
            "gen_s": statistics.median(gen[s] for s in steady), "staleness": statistics.mean(stale.values()),
            "partial_rows": statistics.mean(h("async/partial_rows").values() or [0.0])}


def time_to(c: dict, threshold: float) -> float | None:
    acc = c["accuracy"]
    for i in range(1, len(acc)):
        if (acc[i - 1][1] + acc[i][1]) / 2 >= threshold:
            return c["clock"][acc[i][0]]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="hybrid,split,one_step,stream", help=f"of {', '.join(MODES)}; split is needed")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--task", choices=["default", "agent"], default="default")
    ap.add_argument("--tool-s", type=float, default=0.5, help="--task agent: seconds a tool call takes")
    ap.add_argument("--work", help="directory for the runs (default: a temporary one)")
    ap.add_argument("--out", help="write every curve and the summary here (JSON)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="rlflow_async_"))
    work.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")

    # the warm start, once: every run below starts RL from the model it writes
    agent = args.task == "agent"
    conf = [str(ROOT / "conf" / "demo-agent.yaml")] if agent else []
    rlflow(work, "warm", "trainer.total_steps=1", "trainer.val_every=0", "trainer.val_samples=0", conf=conf)
    warm = work / "warm"
    data = warm / "embedded" / ("calc" if agent else "data")
    common = [f"model.path={warm / 'warmstart'}", f"data.train_files=[{data / 'train.parquet'}]",
              f"data.val_files=[{data / 'val.parquet'}]", "warmstart.steps=0", "warmstart.stop_accuracy=0",
              "trainer.val_samples=0"]
    if agent:  # the native engine: generation is long through the tool's calls
        common += ["rollout.env=bench/slow_calc.py:SlowCalculator"]
    else:  # the default's phase split (native engine, hybrid): what overlap could give there
        default = curve(client, rlflow(work, "default_phases", *common, "trainer.total_steps=6",
                                       "trainer.val_every=0"))
        g, s = default["gen_s"], default["step_s"]
        print(f"embedded default, native engine, hybrid: step {s:.3f} s, generation {g:.3f} s; an overlap could "
              f"give at most {s / max(g, s - g):.2f}x")
        common += ["rollout.backend=hf"]

    runs: dict[str, dict[int, dict]] = {m: {} for m in args.modes.split(",")}
    for seed in [int(x) for x in args.seeds.split(",")]:
        for mode in runs:
            extra = MODES[mode]
            name = f"{mode}_seed{seed}"
            runs[mode][seed] = curve(client, rlflow(work, name, *common, *extra, f"trainer.seed={seed}",
                                                    f"trainer.total_steps={args.steps}",
                                                    f"trainer.val_every={args.val_every}", conf=conf,
                                                    tool_s=args.tool_s if agent else 0.0))
            c = runs[mode][seed]
            print(f"{name}: step {c['step_s']:.3f} s (generation {c['gen_s']:.3f} s), mean staleness "
                  f"{c['staleness']:.2f}, rows spanning versions {c['partial_rows']:.2f}, accuracy "
                  + " ".join(f"{a:.3f}@{st}" for st, a in c["accuracy"]), flush=True)

    best = {seed: max((a + b[1]) / 2 for (_, a), b in zip(c["accuracy"], c["accuracy"][1:]))
            for seed, c in runs["split"].items()}
    threshold = min(best.values())
    print(f"\nthreshold: smoothed held-out accuracy {threshold:.3f} (every synchronous split run reaches it)")
    print("| mode | seed | median step s | generation s | time to threshold s |\n|---|---|---|---|---|")
    summary: dict[str, dict] = {}
    for mode, by_seed in runs.items():
        for seed, c in by_seed.items():
            t = time_to(c, threshold)
            c["time_to_threshold_s"] = t
            reached = "not reached" if t is None else f"{t:.1f}"
            print(f"| {mode} | {seed} | {c['step_s']:.3f} | {c['gen_s']:.3f} | {reached} |")
        steps = [c["step_s"] for c in by_seed.values()]
        summary[mode] = {"step_s": statistics.median(steps), "step_s_range": [min(steps), max(steps)]}
    split_step, split_gen = summary["split"]["step_s"], statistics.median(c["gen_s"] for c in runs["split"].values())
    ideal = split_step / max(split_gen, split_step - split_gen)
    got = {m: split_step / summary[m]["step_s"] for m in runs if m != "split"}
    print(f"\nsplit synchronous step {split_step:.3f} s, its generation {split_gen:.3f} s: ideal overlap {ideal:.2f}x; "
          + "; ".join(f"{m} gives {g:.2f}x the step rate ({(g - 1) / (ideal - 1) if ideal > 1 else float('nan'):.0%} "
                      "of the ideal gain)" for m, g in got.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"threshold": threshold, "runs": runs, "summary": summary,
                                              "ideal": ideal, "speedup": got}, indent=1, default=str))


if __name__ == "__main__":
    main()

"""A shipped recipe run as a user runs it, on whatever device is here: `bench/gsm8k_like.py`'s model
and rows, then `rlflow train RECIPE` with only the model, the data and the number of steps set.
Prints the settings the recipe resolved to (device, dtypes, limits, learning rate), and each
step's time and the peak memory of each phase, read back from the run's MLflow store.

    python bench/recipe_run.py --recipe gsm8k --shape qwen2.5-0.5b --steps 5
    python bench/recipe_run.py --recipe gsm8k-lora --shape qwen2.5-7b --steps 3 --set trainer.log_checkpoint=false
    python bench/recipe_run.py --recipe smoke --shape tiny --steps 2 --out /tmp/recipe   # CPU smoke

Writes under --out: the model and rows (gsm8k_like), the run's directory and, without
MLFLOW_TRACKING_URI, its MLflow file store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("model.dtype", "rollout.dtype", "placement.gpus_per_worker", "placement.workers", "data.max_prompt_tokens",
         "rollout.max_new_tokens", "data.prompts_per_step", "rollout.samples_per_prompt", "actor.lr",
         "actor.micro_batch_tokens_per_gpu", "actor.pack_sequences", "actor.compile_layers",
         "actor.activation_checkpointing", "actor.lora_rank", "rollout.free_cache", "warmstart.steps")


def rlflow(*args: str, env: dict[str, str], log: Path | None = None) -> str:
    cmd = [sys.executable, "-m", "rlflow.pipelines.cli", *args]
    if log is None:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"rlflow train exited {rc}:\n{log.read_text()[-4000:]}")
    return log.read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="gsm8k")
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp/recipe_run"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting beside the model, data and steps (say so wherever its numbers are reported)")
    args = ap.parse_args()

    data = args.out / "data"
    subprocess.run([sys.executable, str(ROOT / "bench" / "gsm8k_like.py"), "--out", str(data), "--shape", args.shape],
                   check=True)
    settings = [*(data / "args").read_text().split(), f"trainer.total_steps={args.steps}",
                f"trainer.output_dir={args.out / 'run'}", *args.set]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if "MLFLOW_TRACKING_URI" not in env:
        env |= {"MLFLOW_TRACKING_URI": f"file:{args.out / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    resolved = yaml.safe_load(rlflow("config", args.recipe, *settings, env=env))
    print(f"rlflow train {args.recipe} {' '.join(settings)}\nresolved:")
    for key in SHOWN:
        section, name = key.split(".")
        print(f"  {key} = {resolved[section][name]}")
    start = time.perf_counter()
    rlflow("train", args.recipe, *settings, env=env, log=args.out / "train.log")
    print(f"the job took {time.perf_counter() - start:.0f} s (log: {args.out / 'train.log'})")

    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               order_by=["attributes.start_time DESC"], max_results=1)
    history = {k: sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)
               for k in run.data.metrics if k.startswith(("timing_s/", "perf/max_memory_allocated_gb/"))}
    steps = [m.value for m in history.get("timing_s/step", [])]
    print(f"run {run.info.run_id}: steps {', '.join(f'{s:.2f}' for s in steps)} s"
          + (f"; median after the first {statistics.median(steps[1:]):.2f} s" if len(steps) > 1 else ""))
    for key in sorted(k for k in history if k.startswith("timing_s/") and k != "timing_s/step"):
        print(f"  {key}: {', '.join(f'{m.value:.2f}' for m in history[key])}")
    for key in sorted(k for k in history if k.startswith("perf/max")):
        print(f"  {key}: max {max(m.value for m in history[key]):.1f} GiB")


if __name__ == "__main__":
    main()

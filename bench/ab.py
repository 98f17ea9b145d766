"""This checkout's speed against another's, side by side: one bench script run in both, alternately.

    python bench/ab.py --base /path/to/old/checkout --pairs 3 e2e --shape qwen2.5-0.5b --trl-modes '' \\
        --steps 5 --warmup 2 --rlflow-set actor.compile_layers=true
    python bench/ab.py --base /path/to/old/checkout --pairs 3 rollout --shape qwen2.5-0.5b --seqs 256 --hf-cache none

Runs base, new, base, new, ... (`--pairs` of each, alternating so that a drift of the host's speed
falls on both alike), each as `python bench/<script>.py ARGS` in its own checkout (PYTHONPATH is
that checkout first, then whatever PYTHONPATH held). It reads rlflow's step time and tokens/s/GPU
from e2e.py's JSON, or the native engine's tokens/s from rollout.py's output, and prints each
pair's new/base ratio and their median, min and max. A step-time ratio under 1 and a tokens/s
ratio over 1 mean the new checkout is faster. Logs go to --out (default $OUT or bench/out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(checkout: Path, script: str, args: list[str], log) -> dict[str, float]:
    """One run of `script` in `checkout`: its numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OUT": tmp, "PYTHONPATH": os.pathsep.join(
            [str(checkout)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        proc = subprocess.run([sys.executable, f"bench/{script}.py", *args], cwd=checkout, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log.write(f"\n===== {checkout} bench/{script}.py {' '.join(args)}\n{proc.stdout}")
        log.flush()
        if proc.returncode:
            raise SystemExit(f"bench/{script}.py failed in {checkout} (exit {proc.returncode}); see {log.name}")
        if script == "e2e":
            row = next(r for r in json.loads((Path(tmp) / "e2e.json").read_text())["results"]
                       if r["framework"] == "rlflow")
            return {"step_s": row["step_s"], "tok_s_gpu": row["tok_s_gpu"]}
    match = re.search(r"^\s*native\s+([\d.]+) s\s+([\d,]+) tok/s", proc.stdout, re.M)
    if not match:
        raise SystemExit(f"no native tok/s line in bench/{script}.py's output; see {log.name}")
    return {"gen_s": float(match[1]), "tok_s": float(match[2].replace(",", ""))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the checkout to compare against")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    ap.add_argument("script", choices=["e2e", "rollout"])
    args, rest = ap.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with open(args.out / f"ab_{args.script}.log", "w") as log:
        for i in range(args.pairs):
            for side, checkout in (("base", args.base.resolve()), ("new", ROOT)):
                runs[side].append(measure(checkout, args.script, rest, log))
                print(f"pair {i + 1} {side}: {runs[side][-1]}", flush=True)
    summary = {}
    for key in runs["new"][0]:
        ratios = [n[key] / b[key] for n, b in zip(runs["new"], runs["base"])]
        summary[key] = {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"{key}: new/base median {summary[key]['median']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"pairs " + ", ".join(f"{r:.3f}" for r in ratios))
    (args.out / f"ab_{args.script}.json").write_text(json.dumps({"args": rest, "runs": runs, "summary": summary},
                                                                indent=1))


if __name__ == "__main__":
    main()

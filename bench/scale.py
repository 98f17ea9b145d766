"""GRPO on the hybrid engine over more and more GPUs: the step split, throughput and memory per GPU count.

    python bench/scale.py --shape qwen2.5-7b --gpus 2,4 --tp 2
    python bench/scale.py --shape tiny --gpus 0 --prompts 4 --samples 2 --prompt-len 16 --new 8 --steps 3 \
        --warmup 1 --mini-batches 2   # CPU smoke

For each GPU count, the real job (`python -m rlflow.pipelines.cli train`: Ray, compiled DAG, MLflow) on
the same random-weight model and prompts as `bench/e2e.py` (every prompt `--prompt-len` tokens,
every completion `--new` tokens: EOS is never sampled), with what a GRPO run does on a big model:
FSDP2 over all GPUs, generation tensor parallel over `--tp` GPUs, a KL loss against the reference
model, `--mini-batches` optimizer steps per generated batch (so old logprobs need a forward of
their own), activation checkpointing and packed micro-batches. Extra `key=value` arguments
override the job's config.

Per GPU count it prints the medians over the steps after `--warmup` of: the step and its parts
(`timing_s/*`: gen, old_log_prob, ref, update_actor, and the switch: the memory hand-over plus the
reshard into the generation layout), tokens/s/GPU, the peak memory per phase (a rank's
max_memory_allocated, averaged over ranks), and the reshard against its floor: the bytes a rank
receives from its peers (`perf/reshard_gb_from_peers`) over the all-to-all bandwidth measured on
the same GPUs just before the job. A `--gpus 0` entry runs one CPU rank (a smoke run). Writes JSON
to `--out` ($OUT/scale.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import e2e  # bench/ is sys.path[0] when a script here runs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from reshard import alltoall_gbps
from shapes import free_port

PHASES = ("gen", "switch", "reshard", "ref", "old_log_prob", "update_actor")


def bandwidth_worker(rank: int, world: int, port: int, out: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        gbps = alltoall_gbps(2**30, "cuda")
        if rank == 0:
            out.put(gbps)
    finally:
        dist.destroy_process_group()


def alltoall_bandwidth(gpus: int) -> float | None:
    """GB/s a rank receives from its peers in a 1 GiB all-to-all over `gpus` GPUs (None below 2)."""
    if gpus < 2:
        return None
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(bandwidth_worker, args=(gpus, free_port(), out), nprocs=gpus, start_method="spawn")
    return float(out.get())


def job_conf(args: argparse.Namespace, gpus: int, model: Path, train: Path, val: Path, out: Path) -> dict:
    conf = e2e.rlflow_conf(args, gpus > 0, model, train, val, out)
    conf["placement"] = dict(workers=max(1, gpus), gpus_per_worker=1 if gpus else 0)
    conf["rollout"].update(tp=args.tp if gpus else 1)
    conf["trainer"].update(log_checkpoint=False)  # a 7B checkpoint is ~90 GB; a copy in the run would double it
    conf["actor"].update(mini_batch_prompts=args.prompts // args.mini_batches, kl_loss_coef=args.kl,
                         activation_checkpointing=bool(gpus), pack_sequences=bool(gpus))
    return conf


def run(args: argparse.Namespace, gpus: int, model: Path, train: Path, val: Path, work: Path) -> dict:
    work.mkdir()
    gbps = alltoall_bandwidth(gpus)
    conf = work / "rlflow.yaml"
    conf.write_text(yaml.safe_dump(job_conf(args, gpus, model, train, val, work / "out"), sort_keys=False))
    settings = e2e.non_defaults(conf)
    print(f"{gpus or 'CPU'} GPU(s): " + ", ".join(f"{k}={v}" for k, v in settings.items()) + " "
          + " ".join(args.overrides), flush=True)
    uri = e2e.tracking_uri(work)
    env = e2e.child_env(MLFLOW_TRACKING_URI=uri, MLFLOW_ALLOW_FILE_STORE="true")
    rc, tail = e2e.run_logged([sys.executable, "-m", "rlflow.pipelines.cli", "train", str(conf), *args.overrides],
                              work / "rlflow.log", env)
    if rc:  # e.g. a 7B run's final checkpoint (~90 GB) and MLflow's copy filled the disk
        print(f"  the job failed (exit {rc}); the steps it logged are read all the same. Log "
              f"{work / 'rlflow.log'} ends:\n{tail[-2000:]}", flush=True)
    m = e2e.read_metrics(uri, finished=not rc)
    missing = sorted(set(range(1, args.steps + 1)) - set(m.get("timing_s/step", {})))
    if missing:
        raise SystemExit(f"the job logged no steps {missing}")
    timed = range(args.warmup + 1, args.steps + 1)
    med = lambda key: statistics.median(m[key][s] for s in timed) if key in m else 0.0  # noqa: E731
    row = {"gpus": gpus, "tp": args.tp if gpus else 1, "job_exit": rc, "step_s": med("timing_s/step"),
           **{f"{p}_s": med(f"timing_s/{p}") for p in PHASES}, "tok_s_gpu": med("perf/throughput"),
           "reshard_gb": med("perf/reshard_gb_from_peers"), "alltoall_gbps": gbps,
           "peak_gib": {p: max(m[f"perf/max_memory_allocated_gb/{p}"].values()) for p in PHASES
                        if f"perf/max_memory_allocated_gb/{p}" in m},
           "probs_diff_mean": med("training/rollout_probs_diff_mean"),
           "probs_diff_max": max(m["training/rollout_probs_diff_max"].values()),
           "score": [m["critic/score/mean"][s] for s in sorted(m["critic/score/mean"])], "settings": settings}
    row["reshard_floor_s"] = row["reshard_gb"] / gbps if gbps else None
    print(f"  step {row['step_s']:.2f} s: " + ", ".join(f"{p} {row[f'{p}_s']:.2f}" for p in PHASES)
          + f"; {row['tok_s_gpu']:,.0f} tokens/s/GPU; peaks " + ", ".join(f"{p} {v:.1f} GiB" for p, v in
                                                                         row["peak_gib"].items()), flush=True)
    return row


def table(rows: list[dict]) -> str:
    floor = lambda r: "-" if r["reshard_floor_s"] is None else (  # noqa: E731
        f"{r['reshard_floor_s'] * 1e3:.0f} ms ({r['reshard_gb']:.2f} GB at {r['alltoall_gbps']:.0f} GB/s)")
    base = rows[0]["tok_s_gpu"]
    lines = ["| GPUs | gen TP | step s | gen | old logprob | ref | update | switch (memory + reshard) | reshard floor "
             "| tokens/s/GPU | vs first row | peak GiB gen / ref / old / update |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peaks = " / ".join(f"{r['peak_gib'][p]:.1f}" if p in r["peak_gib"] else "-"
                           for p in ("gen", "ref", "old_log_prob", "update_actor"))
        lines.append(
            f"| {r['gpus'] or 'CPU'} | {r['tp']} | {r['step_s']:.2f} | {r['gen_s']:.2f} | {r['old_log_prob_s']:.2f} | "
            f"{r['ref_s']:.2f} | {r['update_actor_s']:.2f} | {r['switch_s'] + r['reshard_s']:.3f} "
            f"({r['switch_s']:.3f} + {r['reshard_s']:.3f}) | {floor(r)} | {r['tok_s_gpu']:,.0f} | "
            f"{r['tok_s_gpu'] / base:.2f} | {peaks} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(e2e.SHAPES))
    ap.add_argument("--gpus", default="2,4", help="comma list of GPU counts, one job each (0: one CPU rank)")
    ap.add_argument("--tp", type=int, default=2, help="generation tensor-parallel size")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=256, help="tokens per completion (EOS never sampled)")
    ap.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per generated batch")
    ap.add_argument("--kl", type=float, default=0.001, help="actor.kl_loss_coef: the reference model's forward")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rlflow-micro-tokens", type=int, default=16384, help="actor.micro_batch_tokens_per_gpu")
    ap.add_argument("--work", help="keep the models, logs and MLflow stores here (default: a temporary directory)")
    ap.add_argument("--out", default=str(Path(os.environ["OUT"]) / "scale.json") if os.environ.get("OUT")
                    else str(e2e.BENCH / "out" / "scale.json"))
    ap.add_argument("overrides", nargs="*", help="more key=value config overrides for every job")
    args = ap.parse_args()
    counts = [int(g) for g in args.gpus.split(",") if g]
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if any(g and g % args.tp for g in counts):
        raise SystemExit(f"--tp {args.tp} must divide every GPU count in {counts}")
    if any(g > torch.cuda.device_count() for g in counts):
        raise SystemExit(f"asked for {max(counts)} GPUs; this machine has {torch.cuda.device_count()}")
    cuda = max(counts) > 0
    with tempfile.TemporaryDirectory(prefix="scale_") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model, train, val = e2e.build_inputs(work, args.shape, args, torch.bfloat16 if cuda else torch.float32,
                                         "cuda" if cuda else "cpu")
        print(f"{args.shape}: {args.prompts} prompts x {args.samples} samples, {args.prompt_len} -> {args.new} "
              f"tokens, {args.mini_batches} mini-batches, KL coef {args.kl}, {args.steps} steps "
              f"({args.warmup} warm-up), work dir {work}", flush=True)
        rows = [run(args, g, model, train, val, work / f"gpus{g}") for g in counts]
    print("\n" + table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "device": e2e.device_name(cuda), "results": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

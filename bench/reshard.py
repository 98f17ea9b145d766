"""The hybrid engine's switch: FSDP2 training shards <-> the native engine's generation layout,
in place, against a reload baseline, side by side on the same GPUs.

    python bench/reshard.py --gpus 2 --shape qwen2.5-1.5b --tp 1,2
    python bench/reshard.py --gpus 2 --shape tiny --tp 1,2 --device cpu     # CPU smoke run, gloo
    python bench/reshard.py --gpus 2 --shape deep --tp 1,2 --slots 8 --max-len 64  # the per-tensor host work
    python bench/reshard.py --gpus 2 --shape qwen2.5-7b --tp 2 --repeats 3 --profile  # where a switch's time goes

Random weights in the given model shape (saved once as a bf16 HF directory under --cache), the
real engines: `engine.train.fsdp.TrainEngine` (FSDP2 over all ranks, float32 master weights, AdamW
state made by one training step) and `engine.rollout.native.NativeRollout` (bf16, tensor parallel over
groups of t ranks) with a KV cache for `--slots` x `--max-len` tokens. Per TP size, median of
`--repeats`, each phase timed on every rank between barriers (the max over ranks):
- train -> generate: gradients freed, optimizer state to pinned CPU (`--offload`), KV cache
  allocated, weights resharded (`engine.reshard.Resharder.sync`) into the rollout's memory,
  mapped again first (on CUDA);
- generate -> train: KV cache and the rollout's weights freed, optimizer state back (as
  `rollout.free_cache=true` has the pipeline do);
- reshard floor: the bytes a rank must receive from other ranks for its generation shard, over
  the all-to-all bandwidth measured in the same run (a buffer of the same size); on one GPU, the
  fp32 master read plus the bf16 copy written, at the device copy bandwidth measured alike;
- switch floor: that plus the optimizer state over the device -> pinned host bandwidth measured alike;
- whether the decode CUDA graphs survived each switch (the same graph objects after it: the KV
  cache and weights come back at the same addresses);
- reload baseline: the full state dict gathered, then a fresh NativeRollout built from it, made
  ready to generate (its decode graphs captured); in memory, the favourable case for the
  baseline: nothing goes through a disk.
Peak memory (max_memory_allocated) is reported per phase on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shapes import QWEN25, copy_tbps, free_port, model_dir, profile, timed  # bench/shapes.py, on sys.path

TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)
# tiny: a CPU smoke run. deep: the 28 layers of the 1.5B and 7B shapes (their count of tensors and
# blocks) at tiny width, where a switch's time is the host's work per tensor, not its bytes
SHAPES = {**QWEN25, "tiny": TINY, "deep": dict(TINY, num_hidden_layers=28)}


def peak_gb(device: str) -> float:
    from rlflow.engine import vmm

    return vmm.peak_bytes() / 2**30 if device == "cuda" else 0.0


def alltoall_gbps(nbytes: int, device: str) -> float:
    """Bytes received from peers per second by an all_to_all_single moving `nbytes` to each rank."""
    world = dist.get_world_size()
    n = max(1, nbytes // 2 // world * world)  # bf16 elements, divisible by world
    send = torch.empty(n, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # warm-up
    t = statistics.median(timed(lambda: dist.all_to_all_single(recv, send), device) for _ in range(5))
    return n * 2 * (world - 1) / world / t / 1e9


def one_train_step(engine: Any, vocab: int) -> None:
    """A small real update, so AdamW's state exists (as it does after the first RL step)."""
    from rlflow.engine.train.fsdp import forward_logprobs

    ids = torch.randint(0, vocab, (4, 64))
    ones = torch.ones_like(ids)
    with engine.step(1) as step:
        step.backward(-forward_logprobs(engine.root, ids, ones, ones.cumsum(1) - 1, ids[:, 32:], 1.0, False,
                                        entropy=False)[0].mean())


def host_gbps(nbytes: int, device: str) -> float:
    """Device -> pinned host bytes per second (the optimizer offload's link), on a buffer of up to 1 GiB."""
    if device != "cuda":
        return float("inf")
    src = torch.empty(max(1, min(nbytes, 2**30)) // 4, dtype=torch.float32, device=device)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    dst.copy_(src)
    t = statistics.median(timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(3))
    return src.numel() * 4 / t / 1e9


def measure(engine: Any, tp: Any, args: argparse.Namespace, world: int, train_peak: float, tok: Any) -> None:
    """Switch times, floors and reload baseline for one generation TP layout; rank 0 prints them."""
    from rlflow.engine.reshard import Resharder
    from rlflow.engine.rollout.base import SamplingParams
    from rlflow.engine.rollout.model import NativeCausalLM
    from rlflow.engine.rollout.native import NativeRollout

    device, rank = args.device, dist.get_rank()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    first = SamplingParams(max_new_tokens=2)  # a fresh engine captures its decode graphs on its first call

    def engine_for(model: Any) -> Any:
        return NativeRollout(model, tok, max_slots=args.slots, max_len=args.max_len)

    with torch.device("meta"):
        rollout_model = NativeCausalLM(engine.model.config, tp)
    rollout_model = rollout_model.materialize(device, dtype)
    rollout = engine_for(rollout_model)
    resharder = Resharder(engine.model, rollout_model)
    resharder.sync()
    rollout.generate([[1, 2, 3]], first)
    rollout.release_memory(weights=True)

    def to_generation() -> None:
        engine.offload() if args.offload else engine.optimizer.zero_grad(set_to_none=True)
        rollout.resume_memory()
        resharder.sync()

    def to_training() -> None:
        rollout.release_memory(weights=True)  # the next switch writes them all
        engine.onload()

    def reload() -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            fresh = NativeCausalLM(engine.model.config, tp)
        fresh = fresh.materialize(device, dtype)
        fresh.load_weights(full.items())
        engine_for(fresh).generate([[1, 2, 3]], first)  # ready to generate at full speed

    down, up, peak, kept = [], [], 0.0, 0
    for _ in range(args.repeats):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = rollout.runner.graphs and next(iter(rollout.runner.graphs.captured.values()))
        down.append(timed(to_generation, device))
        kept += bool(before) and next(iter(rollout.runner.graphs.captured.values())) is before
        peak = max(peak, peak_gb(device))
        up.append(timed(to_training, device))
    rollout.resume_memory()
    resharder.sync()  # the weights' memory mapped again, so what follows times the copies alone
    reshard_only = statistics.median(timed(resharder.sync, device) for _ in range(args.repeats))
    if args.profile:
        dist.barrier()
        profile(resharder.sync, rank)
    if world > 1:  # the bytes that must cross a link, at the measured all-to-all rate
        link, bw = "all-to-all", alltoall_gbps(resharder.bytes_received, device)
        floor = resharder.bytes_from_peers / 1e9 / bw
    else:  # one GPU: read the fp32 master (2x the bf16 bytes) and write the bf16 copy, at copy speed
        link, bw = "copy", copy_tbps(device) * 1e3
        floor = 3 * resharder.bytes_received / 1e9 / bw
    offload_bytes = sum(t.numel() * t.element_size() for t in engine._optimizer_tensors()) if args.offload else 0
    offload_floor = offload_bytes / 1e9 / host_gbps(offload_bytes, device)
    rollout.release_memory()
    engine.offload()  # the baseline, too, runs with generation's memory: optimizer state off the GPU
    baseline = timed(reload, device)
    engine.onload()
    if rank == 0:
        d, u = statistics.median(down), statistics.median(up)
        print(f"  t={tp.size}: reshard {reshard_only * 1e3:.1f} ms: {resharder.bytes_from_peers / 2**30:.2f} GiB from "
              f"peers ({resharder.bytes_received / 2**30:.2f} GiB into the rollout) at {link} {bw:.0f} GB/s, "
              f"floor {floor * 1e3:.1f} ms -> {reshard_only / floor if floor else float('nan'):.1f}x floor\n"
              f"       train->gen {d * 1e3:.1f} ms (with {offload_bytes / 2**30:.1f} GiB optimizer state to pinned "
              f"host, floor {(floor + offload_floor) * 1e3:.1f} ms -> {d / (floor + offload_floor):.1f}x), "
              f"gen->train {u * 1e3:.1f} ms; decode graphs kept in {kept}/{args.repeats} switches\n"
              f"       reload baseline (full state dict -> fresh engine, graphs captured) {baseline * 1e3:.0f} ms "
              f"= {baseline / reshard_only:.0f}x the reshard, {baseline / d:.1f}x train->gen; "
              f"peak {train_peak:.1f} GiB train, {peak:.1f} GiB switch+gen", flush=True)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    from transformers import AutoTokenizer

    from rlflow.engine.rollout.model import TP
    from rlflow.engine.train.fsdp import TrainEngine

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    start = time.perf_counter()
    engine = TrainEngine(path, 1e-5, 0.0, 1.0, 0, 10, "constant", "bfloat16" if device == "cuda" else "float32",
                         device)
    one_train_step(engine, engine.model.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(path)
    if rank == 0:  # setup is most of a run's time on a fresh machine: say where it stands
        print(f"  trainer built and stepped in {time.perf_counter() - start:.0f} s", flush=True)
    peaks = {"train": peak_gb(device)}
    for t in args.tp:
        measure(engine, TP.over_world(t), args, world, peaks["train"], tok)
        if device == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def tp_sizes(gpus: int) -> list[int]:
    """The TP sizes a run over `gpus` ranks measures by default: the powers of two that divide it."""
    return [t for t in (2 ** i for i in range(gpus.bit_length())) if gpus % t == 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    cuda = torch.cuda.device_count()
    ap.add_argument("--gpus", type=int, default=cuda or 2, help="ranks (processes); GPUs on CUDA (default: all)")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--tp", help="comma list of generation TP sizes, each dividing --gpus (default: 1, 2, 4 .. "
                                 "up to --gpus)")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                    help="optimizer state to pinned CPU memory during generation")
    ap.add_argument("--profile", action="store_true", help="profile one more reshard per TP size (rank 0 prints)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "rlflow-bench-models"))
    args = ap.parse_args()
    args.tp = [int(t) for t in args.tp.split(",")] if args.tp else tp_sizes(args.gpus)
    if args.device == "cuda" and args.gpus > cuda:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {cuda} GPU(s)")
    if bad := [t for t in args.tp if t < 1 or args.gpus % t]:
        raise SystemExit(f"--tp {bad}: each TP size must divide --gpus {args.gpus}")
    path = model_dir(args.shape, SHAPES[args.shape], Path(args.cache))
    port = free_port()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.shape}, {args.gpus} x {name}, FSDP2 fp32 master -> bf16 rollout, "
          f"KV cache {args.slots} x {args.max_len}, offload={args.offload}", flush=True)
    mp.spawn(rank_main, args=(args.gpus, port, args, str(path)), nprocs=args.gpus)


if __name__ == "__main__":
    main()

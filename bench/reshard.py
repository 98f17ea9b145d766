"""The hybrid engine's switch: FSDP2 training shards <-> the native engine's generation layout,
in place, against a reload baseline, side by side on the same GPUs.

    python bench/reshard.py --gpus 2 --shape qwen2.5-1.5b --tp 1,2
    python bench/reshard.py --gpus 2 --shape tiny --tp 1,2 --device cpu     # CPU smoke run, gloo

Random weights in the given model shape (saved once as a bf16 HF directory under --cache), the
real engines: `engine.train.TrainEngine` (FSDP2 over all ranks, float32 master weights, AdamW
state made by one training step) and `engine.native.NativeRollout` (bf16, tensor parallel over
groups of t ranks) with a KV cache for `--slots` x `--max-len` tokens. Per TP size, median of
`--repeats`, each phase timed on every rank between barriers (the max over ranks):
- train -> generate: gradients freed, optimizer state to pinned CPU (`--offload`), KV cache
  allocated, weights resharded (`engine.reshard.Resharder.sync`);
- generate -> train: KV cache freed, optimizer state back;
- floor: the bytes a rank must receive from other ranks for its generation shard, over the
  all-to-all bandwidth measured in the same run (a buffer of the same size); on one GPU, the
  fp32 master read plus the bf16 copy written, at the device copy bandwidth measured alike;
- reload baseline: the full state dict gathered, then a fresh NativeRollout built from it
  (in memory, the favourable case for the baseline: nothing goes through a disk).
Peak memory (max_memory_allocated) is reported per phase on rank 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shapes import QWEN25  # bench/shapes.py: bench/ is sys.path[0] when a script here runs

SHAPES = {**QWEN25, "tiny": dict(  # tiny: a CPU smoke run
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)}


def model_dir(shape: str, cache: Path) -> Path:
    """A random-weight HF directory of `shape` (bf16 safetensors and a tokenizer), made once."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from engine.task import build_tokenizer

    path = cache / shape
    if (path / "config.json").is_file():
        return path
    tok = build_tokenizer()
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 7B random init on CPU takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    del model
    torch.cuda.empty_cache()
    return path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn: Any, device: str) -> float:
    """Seconds `fn` takes, the slowest rank's."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    t = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def peak_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def alltoall_gbps(nbytes: int, device: str) -> float:
    """Bytes received from peers per second by an all_to_all_single moving `nbytes` to each rank."""
    world = dist.get_world_size()
    n = max(1, nbytes // 2 // world * world)  # bf16 elements, divisible by world
    send = torch.empty(n, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # warm-up
    t = statistics.median(timed(lambda: dist.all_to_all_single(recv, send), device) for _ in range(5))
    return n * 2 * (world - 1) / world / t / 1e9


def copy_gbps(device: str) -> float:
    """Device memory bandwidth: bytes read + written per second by a 1 GiB copy."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(5))
    return 2 * src.numel() * 2 / t / 1e9


def one_train_step(engine: Any, vocab: int) -> None:
    """A small real update, so AdamW's state exists (as it does after the first RL step)."""
    from engine.train import forward_logprobs

    ids = torch.randint(0, vocab, (4, 64))
    ones = torch.ones_like(ids)
    engine.step(lambda: [lambda: -forward_logprobs(engine.root, ids, ones, ones.cumsum(1) - 1, ids[:, 32:], 1.0,
                                                   False, entropy=False)[0].mean()])


def measure(engine: Any, tp: Any, args: argparse.Namespace, world: int, train_peak: float) -> None:
    """Switch times, floor and reload baseline for one generation TP layout; rank 0 prints them."""
    from engine.native import NativeRollout
    from engine.native_model import NativeCausalLM
    from engine.reshard import Resharder

    device, rank = args.device, dist.get_rank()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        rollout_model = NativeCausalLM(engine.model.config, tp)
    rollout_model = rollout_model.to_empty(device=device).to(dtype)
    rollout = NativeRollout(rollout_model, None, max_slots=args.slots, max_len=args.max_len)
    resharder = Resharder(engine.model, rollout_model)
    rollout.release_memory()

    def to_generation() -> None:
        engine.offload() if args.offload else engine.optimizer.zero_grad(set_to_none=True)
        rollout.resume_memory()
        resharder.sync()

    def to_training() -> None:
        rollout.release_memory()
        engine.onload()

    def reload() -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            fresh = NativeCausalLM(engine.model.config, tp)
        fresh = fresh.to_empty(device=device).to(dtype)
        fresh.load_weights(full.items())
        NativeRollout(fresh, None, max_slots=args.slots, max_len=args.max_len)

    down, up, peak = [], [], 0.0
    for _ in range(args.repeats):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        down.append(timed(to_generation, device))
        peak = max(peak, peak_gb(device))
        up.append(timed(to_training, device))
    reshard_only = statistics.median(timed(resharder.sync, device) for _ in range(args.repeats))
    if world > 1:  # the bytes that must cross a link, at the measured all-to-all rate
        link, bw = "all-to-all", alltoall_gbps(resharder.bytes_received, device)
        floor = resharder.bytes_from_peers / 1e9 / bw
    else:  # one GPU: read the fp32 master (2x the bf16 bytes) and write the bf16 copy, at copy speed
        link, bw = "copy", copy_gbps(device)
        floor = 3 * resharder.bytes_received / 1e9 / bw
    rollout.release_memory()
    baseline = timed(reload, device)
    if rank == 0:
        d, u = statistics.median(down), statistics.median(up)
        print(f"  t={tp.size}: train->gen {d * 1e3:8.1f} ms (reshard alone {reshard_only * 1e3:.1f} ms), "
              f"gen->train {u * 1e3:7.1f} ms; moved {resharder.bytes_from_peers / 2**30:.2f} GiB from peers "
              f"({resharder.bytes_received / 2**30:.2f} GiB into the rollout), {link} {bw:.0f} GB/s, "
              f"floor {floor * 1e3:.1f} ms -> reshard {reshard_only / floor if floor else float('nan'):.1f}x floor; "
              f"reload baseline {baseline * 1e3:.0f} ms = {baseline / d:.0f}x the switch; "
              f"peak {train_peak:.1f} GiB train, {peak:.1f} GiB switch+gen", flush=True)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    from engine.native_model import TP
    from engine.train import TrainEngine

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    start = time.perf_counter()
    engine = TrainEngine(path, 1e-5, 0.0, 1.0, 0, 10, "constant", "bfloat16" if device == "cuda" else "float32",
                         device)
    one_train_step(engine, engine.model.config.vocab_size)
    if rank == 0:  # setup is most of a run's time on a fresh machine: say where it stands
        print(f"  trainer built and stepped in {time.perf_counter() - start:.0f} s", flush=True)
    peaks = {"train": peak_gb(device)}
    for t in args.tp:
        measure(engine, TP.over_world(t), args, world, peaks["train"])
        if device == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--gpus", type=int, default=2, help="ranks (processes); GPUs on CUDA")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", default="1,2", help="comma list of generation TP sizes (each divides --gpus)")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                    help="optimizer state to pinned CPU memory during generation")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "rlflow-bench-models"))
    args = ap.parse_args()
    args.tp = [int(t) for t in args.tp.split(",")]
    path = model_dir(args.shape, Path(args.cache))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.shape}, {args.gpus} x {name}, FSDP2 fp32 master -> bf16 rollout, "
          f"KV cache {args.slots} x {args.max_len}, offload={args.offload}", flush=True)
    mp.spawn(rank_main, args=(args.gpus, port, args, str(path)), nprocs=args.gpus)


if __name__ == "__main__":
    main()

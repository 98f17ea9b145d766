"""What a training step holds on the GPU, measured beside what `engine.train.memory` predicts:
the trainer's resident state, and the peak of one packed micro-batch of each token count.

    python bench/train_memory.py --shape qwen2.5-1.5b --tokens 4096,8192 --checkpointing 0,1
    python bench/train_memory.py --shape qwen2.5-7b --lora 64 --tokens 4096,8192 --checkpointing 0,1

For each setting, one TrainEngine (the real one: FSDP2, fp32 master weights or a LoRA base in bf16,
AdamW, compiled layers with --compile) steps a PPO-clip loss over one micro-batch of each count of
real tokens (sequences of --seq tokens end to end), twice (the first step allocates the optimizer
state). Prints, per count, the peak allocated memory (torch.cuda.max_memory_allocated) over what
was allocated before the step, the planner's estimate of the same, and their ratio; a ratio above
1 means the planner underestimates. CUDA only.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from shapes import QWEN25, free_port, model_dir  # bench/shapes.py: bench/ is sys.path[0] here
from train import make_batch, rlflow_step
from transformers import AutoConfig

from rlflow.engine.train import memory
from rlflow.engine.train.fsdp import TrainEngine
from rlflow.engine.train.lora import lora_config


def probe(path: Path, args: argparse.Namespace, checkpointing: bool) -> None:
    lora = lora_config(args.lora, 2 * args.lora, ["all-linear"]) if args.lora else None
    engine = TrainEngine(str(path), 1e-6, 0.0, 1.0, 0, 1000, "constant", "bfloat16", "cuda",
                         checkpointing=checkpointing, compile_layers=args.compile, lora=lora)
    model = memory.Model.of(AutoConfig.from_pretrained(path), lora=bool(args.lora))
    for tokens in args.tokens:
        seqs = max(1, tokens // args.seq)
        b = make_batch(seqs, (args.seq // 4, args.seq // 4), (args.seq - args.seq // 4,) * 2, model.vocab, 0)
        for _ in range(2):  # the first step allocates the optimizer state
            engine.optimizer.zero_grad(set_to_none=True)  # as between a pipeline's steps: gradients are the step's
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            rlflow_step(engine, b, tokens, True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        est = memory.step_bytes(model, engine, tokens, checkpointing, states_allocated=True)
        real = int(b["mask"].sum())
        print(f"  ckpt={int(checkpointing)} compile={int(args.compile)} lora={args.lora} tokens={real}: "
              f"resident {before / 2**30:.2f} GiB, step peak +{peak / 2**30:.2f} GiB, "
              f"estimate +{est / 2**30:.2f} GiB, measured/estimate {peak / est:.2f}, "
              f"per token {peak / real / 2**20:.3f} MiB", flush=True)
    del engine
    gc.collect()  # FSDP's hooks hold the engine in cycles
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=QWEN25, default="qwen2.5-1.5b")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank; 0 = full weights")
    ap.add_argument("--tokens", default="4096,8192", help="comma list: real tokens of the one micro-batch")
    ap.add_argument("--seq", type=int, default=2048, help="tokens of each sequence")
    ap.add_argument("--checkpointing", default="0,1", help="comma list of 0/1")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "rlflow-bench-models"))
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    path = model_dir(args.shape, QWEN25[args.shape], Path(args.cache))
    print(f"{args.shape} on {torch.cuda.get_device_name()}", flush=True)
    for ckpt in args.checkpointing.split(","):
        probe(path, args, bool(int(ckpt)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Update-phase throughput: rlflow's trainer, packed and padded, against a plain transformers loop;
and the longest sequence a fixed memory budget trains, without and with sequence parallelism.

    python bench/train.py                                               # tiny random Qwen2, CPU smoke run
    python bench/train.py --shape qwen2.5-1.5b --seqs 64 --budget 16384            # 1 GPU, + the plain loop
    python bench/train.py --shape qwen2.5-7b --gpus 2 --seqs 32 --budget 16384     # FSDP2 over 2 GPUs
    python bench/train.py --shape qwen2.5-1.5b --gpus 2 --longest --sp 1,2 --memory-gib 40

Random weights in the given model shape (saved once as a bf16 HF directory under --cache, no
download). rlflow's path is the real one: `engine.train.fsdp.TrainEngine` (FSDP2 over all ranks,
float32 master weights and AdamW state, bf16 compute on CUDA), stepping a PPO-clip loss over
token-budget micro-batches; each rank gets its own `--seqs` sequences with a realistic length
mix (prompts of `--prompt` tokens, responses uniform in `--response`, default 50-1000):
- packed: sequences end to end, first-fit-decreasing micro-batches of at most `--budget` real tokens;
- padded: padded rows, micro-batches of rows x width <= `--budget`;
- hf (one rank only): a bf16 transformers model and AdamW, `model(...).logits` on the padded
  micro-batches and log_softmax over full fp32 logits, the loop a user would write.
`--modes` picks which of rlflow's two layouts run; `--profile` adds one more packed step under the
profiler.
Each runs once to warm up, then `--repeats` timed steps (median; the slowest rank's time).
Tokens/s counts real tokens over all ranks. MFU (CUDA) = model FLOPs / time / (GPUs x
`--peak-tflops`), model FLOPs = 6 x matmul parameters x tokens (the input embedding is a lookup,
not counted unless tied to the head) + 6 x layers x hidden x sum of squared sequence lengths
(causal attention, forward and backward); recomputation is not counted.
With `--group` G > 1, each run of G rows has one prompt, and `shared` times the same rows with each
prompt computed once (`actor.share_prompts`); its tokens and FLOPs are still counted per sequence,
so its MFU is the effective one.
The header names the attention kernel (flash-attn, PyTorch's varlen, or SDPA with a mask).
A rank that stalls prints every thread's Python stack on SIGUSR1 (`pkill -USR1 -f spawn_main`).

--longest: one sequence per SP group, `--prompt` min tokens of prompt and the rest response,
activation checkpointing on; the length doubles from --start until the peak memory
(max_memory_allocated, the largest rank's) passes --memory-gib, for every --sp size.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shapes import QWEN25, free_port, model_dir, profile, timed  # bench/shapes.py: bench/ is sys.path[0] here
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.engine import algos
from rlflow.engine.train.batching import micro_batches
from rlflow.engine.train.fsdp import TrainEngine, attn_implementation, forward_logprobs

SHAPES = {**QWEN25, "tiny": dict(  # tiny: a CPU smoke run
    hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True)}


def make_batch(seqs: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int, seed: int,
               group: int = 1) -> dict:
    """Left-padded prompts + right-padded responses as the trainer gets them, with random advantages;
    each run of `group` rows has one prompt (GRPO's samples of a prompt)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt[0], prompt[1] + 1, (-(-seqs // group),), generator=g).repeat_interleave(group)[:seqs]
    rlen = torch.randint(response[0], response[1] + 1, (seqs,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    cols = torch.arange(P + R)
    mask = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()  # [N, P+R]
    ids = torch.randint(3, vocab, (seqs, P + R), generator=g)
    ids[:, :P] = ids[::group, :P].repeat_interleave(group, 0)[:seqs]
    ids *= mask
    rmask = mask[:, P:].float()
    return dict(ids=ids, mask=mask, pos=(mask.cumsum(1) - 1).clamp(min=0), responses=ids[:, P:], rmask=rmask,
                adv=torch.randn(seqs, 1, generator=g) * rmask, old=-torch.rand(seqs, R, generator=g) * 5 * rmask)


def ppo_loss(logp: torch.Tensor, b: dict, rows: torch.Tensor, denom: float) -> torch.Tensor:
    dev = logp.device
    loss, _ = algos.policy_loss(logp, b["old"][rows].to(dev), b["adv"][rows].to(dev), b["rmask"][rows].to(dev),
                                0.2, 0.2, None, "token-mean", denom, b["responses"].shape[1], "ppo")
    return loss


def rlflow_losses(root, b: dict, budget: int, pack: bool, group: int = 0) -> list[Callable[[], torch.Tensor]]:
    """With `group`, runs of that many rows compute their shared prompt once (share_prompts)."""
    denom = float(b["rmask"].sum())

    def loss(rows: torch.Tensor) -> torch.Tensor:
        logp, _ = forward_logprobs(root, b["ids"][rows], b["mask"][rows], b["pos"][rows], b["responses"][rows],
                                   1.0, pack, share=group > 0)
        return ppo_loss(logp, b, rows, denom)
    width = b["mask"].shape[1] - b["responses"].shape[1] if group else 0
    return [partial(loss, rows) for rows in micro_batches(b["mask"], budget, pack, group, width)]


def rlflow_step(engine: TrainEngine, b: dict, budget: int, pack: bool, group: int = 0) -> dict[str, float]:
    losses = rlflow_losses(engine.root, b, budget, pack, group)
    with engine.step(len(losses)) as step:
        for loss in losses:
            step.backward(loss())
    return step.out


def hf_losses(model, b: dict, budget: int) -> list[Callable[[], torch.Tensor]]:
    """The plain loop: full logits of padded rows, log_softmax, gather."""
    denom, width, dev = float(b["rmask"].sum()), b["responses"].shape[1], model.device

    def loss(rows: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=b["ids"][rows].to(dev), attention_mask=b["mask"][rows].to(dev),
                    position_ids=b["pos"][rows].to(dev), use_cache=False)
        logp = torch.log_softmax(out.logits[:, -width - 1:-1].float(), -1)
        logp = logp.gather(-1, b["responses"][rows].to(dev)[..., None]).squeeze(-1)
        return ppo_loss(logp, b, rows, denom)
    return [partial(loss, rows) for rows in micro_batches(b["mask"], budget, pack=False)]


def hf_step(model, optimizer, losses: list[Callable[[], torch.Tensor]]) -> None:
    optimizer.zero_grad(set_to_none=True)
    for micro in losses:
        micro().backward()
    optimizer.step()


def total(value: float, device: torch.device, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def peak_gib(device: torch.device) -> float:
    """The largest rank's peak allocated memory since the last reset, then reset."""
    if device.type != "cuda":
        return 0.0
    peak = total(torch.cuda.max_memory_allocated() / 2**30, device, dist.ReduceOp.MAX)
    torch.cuda.reset_peak_memory_stats()
    return peak


def model_flops(cfg, mask: torch.Tensor) -> float:
    """6 x matmul parameters x real tokens + causal attention's 6 x layers x hidden x sum(L^2)."""
    h, layers, kv = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = h // cfg.num_attention_heads
    per_layer = h * (h + 2 * kv * head_dim) + h * h + 3 * h * cfg.intermediate_size  # qkv, o, gate/up/down
    matmul = layers * per_layer + cfg.vocab_size * h  # + the lm_head
    lengths = mask.sum(1).double()
    return 6 * matmul * float(lengths.sum()) + 6 * layers * h * float((lengths ** 2).sum())


def throughput(rank: int, world: int, args, path: str, device: torch.device) -> None:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = AutoConfig.from_pretrained(path)
    b = make_batch(args.seqs, args.prompt, args.response, cfg.vocab_size, rank, args.group)
    tokens = total(float(b["mask"].sum()), device)
    flops = total(model_flops(cfg, b["mask"]), device)
    padded = total(float(b["mask"].numel()), device)
    if rank == 0:
        print(f"  {world} rank(s) x {args.seqs} seqs: {tokens:.0f} real tokens ({tokens / padded:.0%} of the "
              f"padded rows), budget {args.budget} tokens per micro-batch", flush=True)
    make_engine = partial(TrainEngine, path, 1e-6, 0.0, 1.0, 0, 1000, "constant", dtype, str(device),
                          checkpointing=args.checkpointing, compile_layers=args.compile)
    engine = make_engine()
    methods: dict[str, Callable[[], object]] = {
        "packed": partial(rlflow_step, engine, b, args.budget, True),
        "padded": partial(rlflow_step, engine, b, args.budget, False)}
    methods = {k: v for k, v in methods.items() if k in args.modes or (k == "packed" and args.profile)}
    peak_gib(device)
    rates = {}
    for name, run in methods.items():
        rates[name] = report(name, run, tokens, flops, world, args, device, rank)
    if args.profile:
        profile(methods["packed"], rank)
    del engine, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.group > 1:  # the same rows, each group's prompt computed once: an engine with that attention
        shared = make_engine(share_prompts=True)
        rates["shared"] = report("shared", partial(rlflow_step, shared, b, args.budget, True, args.group), tokens,
                                 flops, world, args, device, rank)
        del shared
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if world == 1 and args.hf:
        attn = attn_implementation(device, getattr(torch, dtype))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn)
        model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
        peak_gib(device)
        rates["hf"] = report("hf", lambda: hf_step(model, optimizer, hf_losses(model, b, args.budget)), tokens,
                             flops, world, args, device, rank)
    if rank == 0:
        print(", ".join(f"{x}/{y} {rates[x] / rates[y]:.2f}x" for x, y in
                        (("packed", "hf"), ("padded", "hf"), ("shared", "hf"), ("packed", "padded"),
                         ("shared", "packed")) if x in rates and y in rates), flush=True)


def report(name: str, run: Callable[[], object], tokens: float, flops: float, world: int, args,
           device: torch.device, rank: int) -> float:
    """Warm up, time `--repeats` steps, print tokens/s, MFU and peak memory; tokens/s."""
    run()
    seconds = statistics.median(timed(run, device) for _ in range(args.repeats))
    peak = peak_gib(device)
    if rank == 0:
        mfu = f", MFU {flops / seconds / (world * args.peak_tflops * 1e12):.1%}" if device.type == "cuda" else ""
        print(f"  {name:7s} {seconds:8.3f} s/step  {tokens / seconds:10.0f} tok/s "
              f"({tokens / seconds / world:.0f} per GPU){mfu}, peak {peak:.1f} GiB", flush=True)
    return tokens / seconds


def longest(rank: int, world: int, args, path: str, device: torch.device) -> None:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = AutoConfig.from_pretrained(path)
    for sp in args.sp:
        engine = TrainEngine(path, 1e-6, 0.0, 1.0, 0, 1000, "constant", dtype, str(device), checkpointing=True,
                             sp=sp)
        length, fits = args.start, 0
        peak_gib(device)
        while True:
            prompt = args.prompt[0]  # one sequence per SP group, the same on its ranks
            b = make_batch(1, (prompt, prompt), (length - prompt, length - prompt), cfg.vocab_size, rank // sp)
            seconds = timed(partial(rlflow_step, engine, b, length, False), device)
            peak = peak_gib(device)
            if rank == 0:
                print(f"  sp={sp}: {length:7d} tokens  {seconds:7.2f} s/step  "
                      f"{length * world // sp / seconds:8.0f} tok/s  peak {peak:5.1f} GiB", flush=True)
            if peak <= args.memory_gib:
                fits = length
            if peak > args.memory_gib or length >= args.stop:
                break
            length *= 2
        if rank == 0:
            print(f"sp={sp}: the longest that fits in {args.memory_gib} GiB: {fits} tokens", flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


def rank_main(rank: int, world: int, port: int, args, path: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `pkill -USR1 -f spawn_main`: where a stalled rank is
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    (longest if args.longest else throughput)(rank, world, args, path, device)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--gpus", type=int, default=1, help="ranks (processes); GPUs on CUDA")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per rank")
    ap.add_argument("--prompt", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--response", type=int, nargs=2, default=(50, 1000), metavar=("MIN", "MAX"))
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    ap.add_argument("--group", type=int, default=1,
                    help="rows per prompt (GRPO samples); above 1 also times `shared` (actor.share_prompts)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in the trainer")
    ap.add_argument("--compile", action="store_true", help="the trainer's decoder layers through torch.compile")
    ap.add_argument("--modes", default="packed,padded", help="comma list of rlflow's row layouts to time")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="the plain loop (1 rank)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU; 989 = H100/H200")
    ap.add_argument("--profile", action="store_true", help="profile one more packed step")
    ap.add_argument("--longest", action="store_true", help="the longest-sequence search instead")
    ap.add_argument("--sp", default="1,2", help="--longest: comma list of sequence-parallel sizes")
    ap.add_argument("--start", type=int, default=4096, help="--longest: first length")
    ap.add_argument("--stop", type=int, default=1 << 20, help="--longest: last length tried")
    ap.add_argument("--memory-gib", type=float, default=40.0, help="--longest: the memory budget")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "rlflow-bench-models"))
    args = ap.parse_args()
    args.sp = [int(s) for s in args.sp.split(",")]
    args.modes = args.modes.split(",")
    path = model_dir(args.shape, SHAPES[args.shape], Path(args.cache))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.shape}, {args.gpus} x {name}, FSDP2 fp32 master, {dtype} compute, attention "
          f"{attn_implementation(torch.device(args.device), dtype)}", flush=True)
    port = free_port()
    mp.spawn(rank_main, args=(args.gpus, port, args, str(path)), nprocs=args.gpus)


if __name__ == "__main__":
    main()

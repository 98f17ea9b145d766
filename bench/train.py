"""Update-phase throughput: rlflow's packed and padded trainer forward against a plain transformers loop.

    python bench/train.py                                   # tiny random Qwen2, CPU, about a minute
    python bench/train.py --shape qwen2.5-1.5b --seqs 64 --budget 16384

Random weights in the given model shape (no download), bf16 on the GPU (fp32 on CPU), random
token ids with a realistic length mix: prompts of `--prompt` tokens, responses uniform in
`--response` (default 50-1000). One step = forward + backward of a PPO-clip loss over every
micro-batch + one AdamW step, for the same batch, in one process and one model:
- packed: `engine.train.forward_logprobs`, sequences end to end, first-fit-decreasing micro-batches
  of at most `--budget` real tokens, lm_head in chunks;
- padded: the same forward on padded rows, micro-batches of rows x width <= `--budget`;
- hf: `model(...).logits` on the padded micro-batches and log_softmax over full fp32 logits.
Each method runs once to warm up, then `--repeats` timed steps (median). Tokens/s counts real
(unpadded) tokens for all three; MFU (CUDA) = 6 x params x tokens / time / `--peak-tflops`.
The header names the attention kernel: without flash-attn a packed row runs SDPA with a dense
block-diagonal mask, which still computes budget^2 scores per layer, so large budgets can lose
to padding there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from shapes import QWEN25, sync  # bench/shapes.py: bench/ is sys.path[0] when a script here runs
from transformers import AutoModelForCausalLM, Qwen2Config

from engine import algos
from engine.train import attn_implementation, forward_logprobs, micro_batches

SHAPES = {**QWEN25, "tiny": dict(  # tiny: a CPU smoke run
    hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True)}


def make_batch(seqs: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int, seed: int) -> dict:
    """Left-padded prompts + right-padded responses as the trainer gets them, with random advantages."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt[0], prompt[1] + 1, (seqs,), generator=g)
    rlen = torch.randint(response[0], response[1] + 1, (seqs,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    cols = torch.arange(P + R)
    mask = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()  # [N, P+R]
    ids = torch.randint(3, vocab, (seqs, P + R), generator=g) * mask
    rmask = mask[:, P:].float()
    return dict(ids=ids, mask=mask, pos=(mask.cumsum(1) - 1).clamp(min=0), responses=ids[:, P:], rmask=rmask,
                adv=torch.randn(seqs, 1, generator=g) * rmask, old=-torch.rand(seqs, R, generator=g) * 5 * rmask)


def ppo_loss(logp: torch.Tensor, b: dict, rows: torch.Tensor, denom: float) -> torch.Tensor:
    dev = logp.device
    loss, _ = algos.policy_loss(logp, b["old"][rows].to(dev), b["adv"][rows].to(dev), b["rmask"][rows].to(dev),
                                0.2, 0.2, None, "token-mean", denom, b["responses"].shape[1], "ppo")
    return loss


def rlflow_losses(model, b: dict, budget: int, pack: bool) -> list[Callable[[], torch.Tensor]]:
    denom = float(b["rmask"].sum())

    def loss(rows: torch.Tensor) -> torch.Tensor:
        logp, _ = forward_logprobs(model, b["ids"][rows], b["mask"][rows], b["pos"][rows], b["responses"][rows],
                                   1.0, pack)
        return ppo_loss(logp, b, rows, denom)
    return [partial(loss, rows) for rows in micro_batches(b["mask"], budget, pack)]


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


def step(model, optimizer, losses: list[Callable[[], torch.Tensor]]) -> float:
    """Seconds for one update step over all micro-batches."""
    sync()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    for micro in losses:
        micro().backward()
    optimizer.step()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--response", type=int, nargs=2, default=(50, 1000), metavar=("MIN", "MAX"))
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak; 989 = H200")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    attn = attn_implementation(device, dtype)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[args.shape]), dtype=dtype,
                                             attn_implementation=attn).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    b = make_batch(args.seqs, args.prompt, args.response, SHAPES[args.shape]["vocab_size"], seed=0)
    tokens, padded = int(b["mask"].sum()), b["mask"].numel()
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape} ({params / 1e6:.1f}M params, {dtype}, {attn}) on {device}: {args.seqs} seqs, "
          f"{tokens} real tokens ({tokens / padded:.0%} of {padded} padded), budget {args.budget}")

    methods = {"packed": lambda: rlflow_losses(model, b, args.budget, True),
               "padded": lambda: rlflow_losses(model, b, args.budget, False),
               "hf": lambda: hf_losses(model, b, args.budget)}
    rates = {}
    for name, losses in methods.items():
        step(model, optimizer, losses())  # warm-up
        seconds = statistics.median(step(model, optimizer, losses()) for _ in range(args.repeats))
        rates[name] = tokens / seconds
        mfu = f", MFU {6 * params * tokens / seconds / (args.peak_tflops * 1e12):.1%}" if device.type == "cuda" else ""
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""
        print(f"  {name:7s} {seconds:8.3f} s/step  {rates[name]:10.0f} tok/s{mfu}{peak}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
    print(f"packed/hf {rates['packed'] / rates['hf']:.2f}x, padded/hf {rates['padded'] / rates['hf']:.2f}x, "
          f"packed/padded {rates['packed'] / rates['padded']:.2f}x")


if __name__ == "__main__":
    main()

"""Decode-step kernels side by side: the native engine's attention and sampling against the library
kernels that could do the same, at a model shape's head layout.

    python bench/decode_kernels.py --shape qwen2.5-0.5b --rows 256 --cache 384

Attention, one query per row over its KV-cache slot [rows, KV, L, D], row i live up to a random
length in [L/3, L):
- `written-out`: the math the CPU runs (engine/rollout/model.decode_attention, compiled on CUDA);
- `flash`: PyTorch's flash kernel with per-row lengths (`aten._flash_attention_forward(seqused_k=)`,
  on a sequence-major copy of the cache);
- `flex`: flex attention's decoding, with a block mask of each row's live blocks;
- `triton`: ours (engine/rollout/kernels.py; it also writes the step's K/V), and the same kernel
  with one program a (row, KV head) however few rows there are (`a program a row`): a long tail's
  few long rows are where its split over programs shows (`--rows 4 --cache 16384`).
Each is checked against `written-out`, captured in a CUDA graph and replayed; the floor is the
live K/V read once at --hbm-tbps. Sampling from [rows, vocab] bf16 logits at temperature 1:
engine/rollout/sampling.sample's eager path (Gumbel noise, compiled pick) and its Triton path, called
plainly (host launches included), and the Triton sampler replayed in a CUDA graph, as the engine's
decode graphs run it. On CPU only `written-out` and the eager
sampler run: a smoke run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from shapes import QWEN25, TINY, sync  # bench/shapes.py: bench/ is sys.path[0] when a script here runs

from rlflow.engine.rollout import kernels
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.model import decode_attention, decode_mask
from rlflow.engine.rollout.sampling import sample

SHAPES = {**QWEN25, "tiny": TINY}


def replayed_us(fn: Callable[[], object], cuda: bool, n: int = 50) -> float:
    """Microseconds per call: replays of a CUDA graph of `fn` on CUDA, plain calls on CPU."""
    fn()
    run = fn
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    return timed_us(run, n)


def timed_us(fn: Callable[[], object], n: int = 50) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n * 1e6


def attention_rows(cfg: dict, rows: int, cache: int, device: str, dtype: torch.dtype, tbps: float) -> dict[str, str]:
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    lens = torch.randint(cache // 3, cache - 1, (rows,), device=device)  # cached tokens before this step
    k = torch.randn(rows, KV, cache, D, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, H, D, device=device, dtype=dtype)
    at = torch.arange(rows, device=device)
    k_new, v_new = k[at, :, lens], v[at, :, lens]  # this step's K/V, already in place for the others
    mask = decode_mask(lens, cache, dtype)
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "written-out": lambda: decode_attention(q.view(rows, KV, H // KV, D), k, v, mask)}
    cuda = device == "cuda"
    if cuda:
        seq_k, seq_v = (t.transpose(1, 2).contiguous().view(rows * cache, KV, D) for t in (k, v))
        cu_q = torch.arange(rows + 1, device=device, dtype=torch.int32)
        cu_k, used = cu_q * cache, (lens + 1).to(torch.int32)
        candidates["flash"] = lambda: torch.ops.aten._flash_attention_forward(
            q, seq_k, seq_v, cu_q, cu_k, 1, cache, 0.0, False, False, seqused_k=used)[0]
        candidates["flex"] = flex_decode(q, k, v, lens)
    if kernels.available(q):
        candidates["triton"] = lambda: kernels.decode_attention(q, k_new, v_new, k, v, lens)
        candidates["triton, a program a row"] = lambda: kernels.decode_attention(q, k_new, v_new, k, v, lens, 1)
    want = candidates["written-out"]().reshape(rows, H, D).float()
    floor = 2 * rows * (lens.float().mean().item() + 1) * KV * D * k.itemsize / (tbps * 1e12) * 1e6
    out = {"floor (live K/V once)": f"{floor:.1f} us"}
    for name, fn in candidates.items():
        try:
            err = (fn().reshape(rows, H, D).float() - want).abs().max().item()
            if err > 5e-2:
                raise AssertionError(f"differs from written-out by {err:.1e}")
            out[name] = f"{replayed_us(fn, cuda):.1f} us"
        except Exception as e:  # a library kernel this torch lacks or refuses: reported, not fatal
            out[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    rows, H, D = q.shape
    block, cache = 128, k.shape[2]
    index = torch.arange(cache // block, device=q.device, dtype=torch.int32).expand(rows, 1, 1, -1).contiguous()
    flex = torch.compile(flex_attention, dynamic=False)

    def run() -> torch.Tensor:
        live = ((lens + block) // block).to(torch.int32).view(rows, 1, 1)
        mask = BlockMask.from_kv_blocks(live, index, BLOCK_SIZE=block, mask_mod=lambda b, h, qi, kv: kv <= lens[b],
                                        seq_lengths=(1, cache))
        return flex(q.view(rows, H, 1, D), k, v, block_mask=mask, enable_gqa=True)
    return run


def sampler_rows(cfg: dict, rows: int, device: str, dtype: torch.dtype, tbps: float) -> dict[str, str]:
    logits = torch.randn(rows, cfg["vocab_size"], device=device, dtype=dtype)
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator(device).manual_seed(0)
    floor = logits.numel() * logits.itemsize / (tbps * 1e12) * 1e6
    out = {"floor (logits once)": f"{floor:.1f} us"}
    before = os.environ.get("RLFLOW_TRITON")
    for name, switch in (("eager", "0"), ("triton", "1")):
        os.environ["RLFLOW_TRITON"] = switch  # engine/rollout/kernels.available reads it per call
        if name == "eager" or kernels.available(logits):
            out[name] = f"{timed_us(lambda: sample(logits, params, generator)):.1f} us"
    os.environ.pop("RLFLOW_TRITON")
    if before is not None:
        os.environ["RLFLOW_TRITON"] = before
    if kernels.available(logits):  # as the engine runs it: captured in the decode graph, uniforms drawn outside
        inv_t, uniform = torch.ones(1, device=device), torch.rand(rows, device=device)
        graphed = replayed_us(lambda: kernels.categorical_sample(logits, inv_t, uniform), True)
        out["triton in a graph"] = f"{graphed:.1f} us"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=256, help="decode rows (running sequences)")
    ap.add_argument("--cache", type=int, default=384, help="KV-cache columns per slot (prompt + new tokens)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floors (H200: 4.8)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = SHAPES[args.shape]
    print(f"{args.shape}, {args.rows} rows, {args.cache}-column cache, {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    attention = attention_rows(cfg, args.rows, args.cache, device, dtype, args.hbm_tbps)
    for what, row in (("attention, one layer", attention), ("sampling", sampler_rows(cfg, args.rows, device, dtype,
                                                                                      args.hbm_tbps))):
        print(f"  {what}: " + "; ".join(f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()

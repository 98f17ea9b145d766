"""FP8 weights for the native engine (`rollout.dtype=fp8`): the decoder's linear weights in float8
e4m3 with one float32 scale per output row, their GEMMs through `torch._scaled_mm` with each
activation row quantised on the fly (its own scale, computed in the same step).

Why per output row: a row is one output channel, so its scale multiplies that output after the
GEMM (`_scaled_mm`'s rowwise mode on Hopper takes a scale per activation row and per weight row);
rows are independent, so any split of a tensor's rows quantises alike (below). Per-block scales
(1x128 activations, 128x128 weights) would narrow the error where outlier channels sit beside
small ones, for a block-scaled GEMM; not tried: the random-weight models measured have no
outliers, so e4m3's 3 mantissa bits set the error either way (docs/benchmarks.md).

Invariants:
- `quantize_rows` depends on each row alone (its absolute maximum): quantising a tensor whole, or
  in any split of its rows (the reshard's blocks, a broadcast's buckets), gives the same bits;
- every path quantises a weight's bfloat16 value (`WIRE`): an fp32 trainer shard is cast first, so
  the rows a rank keeps and the rows that travel to it in bf16 land alike;
- per element, |dequantised - w| <= max(|w| * 2**-4, scale * 2**-10), scale = row amax / 448 up to
  a float32 rounding (e4m3 keeps 3 mantissa bits; below its smallest normal the step is fixed);
- the Triton kernel that quantises activations on CUDA (engine/rollout/kernels.py) gives the bits
  `quantize_rows` gives;
- under tensor parallelism each rank scales its own piece: a row-parallel layer's rows are cut
  along the input dim, so a rank's scale covers its columns only (its partial sum is exact to its
  own scale; the all-reduce adds the dequantised partials).

Run: python -m pytest tests/engine/rollout/test_fp8.py (CPU math; `-m gpu` for the GEMM on Hopper).
"""

from __future__ import annotations

import torch

from rlflow.engine.rollout import kernels

FP8 = torch.float8_e4m3fn
WIRE = torch.bfloat16  # fp8 weights travel and are quantised from it; embeddings, norms, biases, lm_head stay in it
MAX = float(torch.finfo(FP8).max)  # 448
# scale = amax * INV_MAX, a product: CUDA torch divides by a scalar as a product with its reciprocal
# and the CPU does not, so a quotient's bits would depend on the device. Both constants are exact in
# float32, so torch on either device and the Triton kernel multiply by the same numbers.
INV_MAX = float(torch.tensor(1 / MAX, dtype=torch.float32))
TINY = 2.0**-40  # the smallest amax a scale is made from: an all-zero row quantises to zeros, not NaN
# Hopper's fp8 MMA accumulating without promotion to fp32 every few k-steps: 3-7% less GEMM time at
# 7B shapes and 256 rows (bench/fp8_gemm.py, one H200), and an error of 2-4e-3 against exact
# accumulation's 1.7e-3, beside the 3-4e-2 that e4m3 rounding itself costs (docs/benchmarks.md)
FAST_ACCUM = True


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, K] in e4m3, its scales [N, 1] float32): row n is q[n] * scale[n]."""
    f = w.to(WIRE).float()
    scale = f.abs().amax(-1, keepdim=True).clamp(min=TINY) * INV_MAX
    return (f / scale).clamp(-MAX, MAX).to(FP8), scale  # the clamp catches rounding past 448


def quantize_into(weight: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> None:
    """Write `w` [n, K] quantised into an fp8 weight's rows `weight` [n, K] and their scales `scale` [n]."""
    q, s = quantize_rows(w)
    weight.copy_(q)
    scale.copy_(s[:, 0])


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of an fp8 weight [N, K] and its scales [N]: what its GEMM multiplies by."""
    return weight.float() * scale[:, None]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (bf16) @ the fp8 weight [N, K] with scales [N], + bias [N] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    # [M, K] e4m3, [M, 1]: one Triton kernel on CUDA, before every GEMM
    q, x_scale = kernels.quantize_fp8(rows, MAX, INV_MAX, TINY) if kernels.available(rows) else quantize_rows(rows)
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale[None], bias=bias, out_dtype=x.dtype,
                           use_fast_accum=FAST_ACCUM)
    return out.view(*x.shape[:-1], weight.shape[0])


def check_device(device: str | torch.device) -> None:
    """Refuse fp8 where `_scaled_mm` has no e4m3 GEMM: anything but CUDA of compute capability 8.9+."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (8, 9):
        raise RuntimeError(f"rollout.dtype=fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or "
                           f"later); this rollout runs on {device}" + (f" of capability {capability}" if capability
                                                                     else ""))

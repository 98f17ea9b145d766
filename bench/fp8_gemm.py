"""The fp8 GEMM of the native engine (engine/rollout/fp8.py) against bf16's, at Qwen2.5 projection shapes.

    python bench/fp8_gemm.py --shape qwen2.5-7b

Per projection and row count (256: a decode step of 256 sequences; 8192: a prefill chunk), in us:
bf16 `F.linear`; `fp8.linear` as the engine runs it (activation quantisation + rowwise
`_scaled_mm`; eager, so at 256 rows it times the kernel launches too); the `_scaled_mm` alone,
without and with fast accumulation, and with per-tensor scales (cuBLASLt's kernel). Medians of
CUDA-event timed runs (`triton.testing.do_bench`). Then each GEMM's error against float64.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from shapes import QWEN25  # bench/shapes.py (bench/ is sys.path[0])
from triton.testing import do_bench

from rlflow.engine.rollout import fp8


def times_us(rows: int, n: int, k: int) -> list[float]:
    """Median microseconds of the four GEMMs (see the module docstring) for x [rows, k] @ w [n, k].T."""
    x, w = torch.randn(rows, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda") * 0.02
    wb = w.bfloat16()
    q, scale = fp8.quantize_rows(w)
    xq, xs = fp8.quantize_rows(x)
    one = torch.ones((), device="cuda")  # per-tensor scales: cuBLASLt's path rather than CUTLASS's rowwise one
    calls = [lambda: F.linear(x, wb), lambda: fp8.linear(x, q, scale[:, 0], None),
             lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.T, out_dtype=torch.bfloat16),
             lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.T, out_dtype=torch.bfloat16,
                                      use_fast_accum=True),
             lambda: torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)]
    return [1e3 * do_bench(call, return_mode="median") for call in calls]


def errors(rows: int, n: int, k: int) -> list[float]:
    """|out - exact| / |exact| of the rowwise fp8 GEMM with and without fast accumulation, exact being
    float64 over the same quantised operands, and of bf16's GEMM against float64 over bf16 operands."""
    x, w = torch.randn(rows, k, device="cuda").bfloat16(), torch.randn(n, k, device="cuda").bfloat16() * 0.02
    q, scale = fp8.quantize_rows(w)
    xq, xs = fp8.quantize_rows(x)
    exact = fp8.dequantize(xq, xs[:, 0]).double() @ fp8.dequantize(q, scale[:, 0]).double().T
    rel = lambda out, ref: ((out.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    return [rel(torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.T, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast), exact) for fast in (False, True)] + \
        [rel(F.linear(x, w), x.double() @ w.double().T)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(QWEN25))
    args = ap.parse_args()
    c = QWEN25[args.shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    projections = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    print(f"{args.shape}: us per GEMM (bf16 | fp8 with quantisation | scaled_mm alone | fast accum | per-tensor)")
    for rows in (256, 8192):
        for name, (n, k) in projections.items():
            us = times_us(rows, n, k)
            err = errors(rows, n, k)
            print(f"  rows {rows:5d} {name:8s} [{n:6d} x {k:6d}]: " + " | ".join(f"{t:7.1f}" for t in us)
                  + f"   bf16 / fp8 = {us[0] / us[1]:.2f}x; error vs exact: fp8 {err[0]:.1e}, fast accum "
                  f"{err[1]:.1e}, bf16 {err[2]:.1e}", flush=True)


if __name__ == "__main__":
    main()

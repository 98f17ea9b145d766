"""Triton kernels for the native engine's decode step on CUDA, where library kernels fall short
(the measurements: docs/benchmarks.md, Rollout, "Triton decode kernels" and "the norms, RoPE and
gating as Triton kernels"; `bench/decode_kernels.py` re-runs the attention and sampler comparison).

- `decode_attention`: one program per (row, KV head) applies RoPE to the step's q and k, writes its
  K/V into the cache and runs that head's G query heads together over the row's live cache columns
  only, with an online softmax. PyTorch's flash kernel with per-row lengths reads every K/V head
  once per query head. While the (row, KV head) pairs are too few to fill the GPU (a step's long
  tail), a long row's columns split over several programs, the last to finish combining their
  pieces.
- `categorical_sample`: a draw from softmax(logits / T) by inverting its CDF at one uniform per
  row: one pass over the vocabulary in chunks gives each chunk's mass, a second kernel picks the
  chunk and scans only it. It reads the logits about once; per-token Gumbel noise (the eager
  path's trick) spent most of its time making the noise.
- `rms_norm`, `add_rms_norm`, `rope` (prefill; decode rotates inside its attention), `silu_mul`: the
  decoder layer's elementwise steps, one launch each (`instead` puts them in place of the
  functions in engine/rollout/model.py). Inductor fuses them as well, but dynamo traced them again
  in every process; a kernel serves every row count and is loaded from Triton's cache.
- `quantize_fp8`: an fp8 engine's activations (engine/rollout/fp8.py), one program per row, before
  every projection's GEMM, with no recompiling as the row width changes from layer to layer.

Invariants:
- the same math as the eager paths (engine/rollout/model.decode_attention, engine/rollout/sampling.sample,
  the functions `instead` replaces) up to rounding: fp32 scores, softmax and elementwise math, one
  rounding to the dtype at the end (the norms round where transformers does); `quantize_fp8`
  gives `fp8.quantize_rows`' bits (IEEE division, round to nearest even);
- the sampler is deterministic: its randomness is the caller's uniforms (the native engine draws
  them from the call's seeded generator), so the same seed gives the same samples (not the eager
  path's samples: a different draw from the same distribution).
`RLFLOW_TRITON=0` switches them all off (the eager paths run instead), e.g. to compare.

Run: python -m pytest -m gpu tests/engine/rollout/test_kernels.py
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the eager paths run
    triton = None


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run for `x`: on CUDA, in half precision (fp32 would get tf32 matmuls)."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("RLFLOW_TRITON", "1") != "0")


if triton is not None:
    @triton.jit
    def _attend(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, lens_ptr, out_ptr, part_m, part_t, part_acc, count_ptr,
                cos_ptr, sin_ptr, scale, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sk_b, sk_h, sk_n, so_b, so_h, s_c,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLITS: tl.constexpr, SPAN: tl.constexpr, ROTATE: tl.constexpr):
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cached = tl.load(lens_ptr + b)
        # the row's columns in pieces of at least SPAN, one a program while they last: a short row
        # runs in program 0 alone, a long one over up to SPLITS programs, the last to finish combining
        per = tl.maximum(SPAN, tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK_N) * BLOCK_N)
        used = tl.maximum(1, tl.cdiv(cached, per))
        if s < used:
            g, d = tl.arange(0, GP), tl.arange(0, D)
            heads = (h * G + g)[:, None]
            q = tl.load(q_ptr + b * sq_b + heads * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
            k_row, v_row = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sk_b + h * sk_h
            # this step's K/V: into the cache for later steps (no program reads that column), and
            # straight into program 0's softmax start
            k_new = tl.load(kn_ptr + b * skn_b + h * skn_h + d)
            v_new = tl.load(vn_ptr + b * svn_b + h * svn_h + d)
            if ROTATE:  # RoPE (rotate-half) on q and k first, each rounded to its dtype as `_rope` does
                other = (d + D // 2) % D  # the partner of column d in the other half
                sign = tl.where(d < D // 2, -1.0, 1.0)
                c = tl.load(cos_ptr + cached * s_c + d).to(tl.float32)  # at the row's position
                n = tl.load(sin_ptr + cached * s_c + d).to(tl.float32) * sign
                q2 = tl.load(q_ptr + b * sq_b + heads * sq_h + other[None, :], mask=(g < G)[:, None], other=0.0)
                q = (q.to(tl.float32) * c[None, :] + q2.to(tl.float32) * n[None, :]).to(q.dtype)
                k2 = tl.load(kn_ptr + b * skn_b + h * skn_h + other)
                k_new = (k_new.to(tl.float32) * c + k2.to(tl.float32) * n).to(k_new.dtype)
            first = s == 0
            if first:
                tl.store(k_row + cached * sk_n + d, k_new)
                tl.store(v_row + cached * sk_n + d, v_new)
            m = tl.where(first, tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale, float("-inf"))
            total = tl.where(first, tl.full([GP], 1.0, tl.float32), 0.0)
            acc = tl.where(first, tl.zeros([GP, D], tl.float32) + v_new.to(tl.float32)[None, :], 0.0)
            lo = s * per
            hi = tl.minimum(cached, lo + per)
            for start in range(lo, hi, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                live = cols < hi
                k = tl.load(k_row + cols[:, None] * sk_n + d[None, :], mask=live[:, None], other=0.0)
                x = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # [GP, BLOCK_N]
                m_new = tl.maximum(m, tl.max(x, 1))
                p = tl.exp(x - m_new[:, None])
                alpha = tl.exp(m - m_new)
                v = tl.load(v_row + cols[:, None] * sk_n + d[None, :], mask=live[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                total = total * alpha + tl.sum(p, 1)
                m = m_new
            out_at = out_ptr + b * so_b + heads * so_h + d[None, :]
            if used == 1:
                tl.store(out_at, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
            else:  # leave this piece's (max, mass, weighted sum); the last piece in combines them all
                at = (b * tl.num_programs(1) + h) * SPLITS
                tl.store(part_m + (at + s) * GP + g, m)
                tl.store(part_t + (at + s) * GP + g, total)
                tl.store(part_acc + ((at + s) * GP + g[:, None]) * D + d[None, :], acc)
                done = tl.atomic_add(count_ptr + b * tl.num_programs(1) + h, 1, sem="acq_rel")
                if done == used - 1:
                    pieces = tl.arange(0, SPLITS)
                    took = (pieces < used)[:, None]
                    ms = tl.load(part_m + (at + pieces[:, None]) * GP + g[None, :], mask=took, other=float("-inf"),
                                 cache_modifier=".cg")  # [SPLITS, GP]
                    ts = tl.load(part_t + (at + pieces[:, None]) * GP + g[None, :], mask=took, other=0.0,
                                 cache_modifier=".cg")
                    accs = tl.load(part_acc + ((at + pieces[:, None, None]) * GP + g[None, :, None]) * D
                                   + d[None, None, :], mask=took[:, :, None], other=0.0,
                                   cache_modifier=".cg")  # [SPLITS, GP, D]
                    top = tl.max(ms, 0)  # [GP]
                    w = tl.exp(ms - top[None, :])  # a piece not taken weighs 0
                    acc = tl.sum(accs * w[:, :, None], 0)
                    total = tl.sum(ts * w, 0)
                    tl.store(out_at, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
                    tl.atomic_xchg(count_ptr + b * tl.num_programs(1) + h, 0)  # ready for the next call

    @triton.jit
    def _chunk_mass(logits_ptr, max_ptr, sum_ptr, V, stride, inv_t_ptr, BLOCK: tl.constexpr):
        """Per (row, chunk of the vocabulary): the largest tempered logit m and sum(exp(x - m))."""
        b, c = tl.program_id(0), tl.program_id(1)
        inv_t = tl.load(inv_t_ptr)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b.to(tl.int64) * stride + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32) * inv_t
        top = tl.max(x, 0)
        out = b * tl.num_programs(1) + c
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - top), 0))

    @triton.jit
    def _pick(logits_ptr, max_ptr, sum_ptr, uniform_ptr, token_ptr, logp_ptr, V, stride, inv_t_ptr, C,
              CP: tl.constexpr, BLOCK: tl.constexpr):
        """Per row, from its chunks' (max, sum): the chunk where the cumulative mass passes the row's
        uniform share of the whole, then the first token in it where the running sum of exp(x - m)
        passes what is left; and that token's logprob over the whole tempered vocabulary."""
        b = tl.program_id(0)
        inv_t = tl.load(inv_t_ptr)
        chunks = tl.arange(0, CP)
        top = tl.load(max_ptr + b * C + chunks, mask=chunks < C, other=float("-inf"))
        peak = tl.max(top, 0)
        mass = tl.load(sum_ptr + b * C + chunks, mask=chunks < C, other=0.0) * tl.exp(top - peak)  # exp(peak) units
        cumulative = tl.cumsum(mass, 0)
        whole = tl.max(cumulative, 0)
        target = tl.load(uniform_ptr + b) * whole
        c = tl.minimum(tl.sum((cumulative <= target).to(tl.int32), 0), C - 1)
        picked = chunks == c
        top_c = tl.sum(tl.where(picked, top, 0.0), 0)
        rest = (target - tl.sum(tl.where(picked, cumulative - mass, 0.0), 0)) / tl.exp(top_c - peak)
        at = tl.arange(0, BLOCK)
        cols = c * BLOCK + at
        x = tl.load(logits_ptr + b.to(tl.int64) * stride + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32) * inv_t
        running = tl.cumsum(tl.exp(x - top_c), 0)
        # the chunk's total was summed in another order: stay below this sum's end, so the pick
        # always lands on a token with mass
        i = tl.sum((running <= tl.minimum(rest, tl.max(running, 0) * 0.99999)).to(tl.int32), 0)
        tl.store(token_ptr + b, c * BLOCK + i)
        tl.store(logp_ptr + b, tl.sum(tl.where(at == i, x, 0.0), 0) - peak - tl.log(whole))

    @triton.jit
    def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, s_x, s_res, s_out, s_sum, eps,
                  ADD: tl.constexpr, BLOCK: tl.constexpr):
        """Row b: h = x (with ADD: x + res, rounded to the dtype and stored), out = w * (h / rms(h))
        with the normalized row rounded to the dtype before the scale, as transformers does."""
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < N
        dtype = out_ptr.dtype.element_ty
        h = tl.load(x_ptr + b * s_x + cols, mask=live, other=0.0)
        if ADD:
            h = (h.to(tl.float32) + tl.load(res_ptr + b * s_res + cols, mask=live, other=0.0).to(tl.float32)).to(dtype)
            tl.store(sum_ptr + b * s_sum + cols, h, mask=live)
        f = h.to(tl.float32)
        normed = (f * tl.rsqrt(tl.sum(f * f, 0) / N + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * s_out + cols, (w * normed).to(dtype), mask=live)

    @triton.jit
    def _rotate(x_ptr, out_ptr, cos_ptr, sin_ptr, b, s, S, heads, s_b, s_s, s_h, s_cb, s_cs,
                HP: tl.constexpr, HALF: tl.constexpr):
        h, d = tl.arange(0, HP)[:, None], tl.arange(0, HALF)[None, :]
        live = h < heads
        x = x_ptr + b * s_b + s * s_s + h * s_h + d
        x1 = tl.load(x, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=live, other=0.0).to(tl.float32)
        c, n = cos_ptr + b * s_cb + s * s_cs + d, sin_ptr + b * s_cb + s * s_cs + d
        out = out_ptr + ((b * S + s) * heads + h) * (2 * HALF) + d  # contiguous [B, S, heads, D]
        dtype = out_ptr.dtype.element_ty
        tl.store(out, (x1 * tl.load(c).to(tl.float32) - x2 * tl.load(n).to(tl.float32)).to(dtype), mask=live)
        tl.store(out + HALF, (x2 * tl.load(c + HALF).to(tl.float32) + x1 * tl.load(n + HALF).to(tl.float32)).to(dtype),
                 mask=live)

    @triton.jit
    def _rope(q_ptr, k_ptr, q_out, k_out, cos_ptr, sin_ptr, S, H, KV, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, s_cb, s_cs,
              HP: tl.constexpr, HALF: tl.constexpr):
        """Token (b, s) of q (program 0 on axis 1) or k (program 1): every head rotated half."""
        t = tl.program_id(0).to(tl.int64)
        b, s = t // S, t % S
        if tl.program_id(1) == 0:
            _rotate(q_ptr, q_out, cos_ptr, sin_ptr, b, s, S, H, sq_b, sq_s, sq_h, s_cb, s_cs, HP, HALF)
        else:
            _rotate(k_ptr, k_out, cos_ptr, sin_ptr, b, s, S, KV, sk_b, sk_s, sk_h, s_cb, s_cs, HP, HALF)

    @triton.jit
    def _silu_mul(x_ptr, out_ptr, N, s_x, s_out, BLOCK: tl.constexpr):
        """Row b, one block of columns: silu(x[:N]) * x[N:]."""
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < N
        gate = tl.load(x_ptr + b * s_x + cols, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + b * s_x + N + cols, mask=live, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + b * s_out + cols, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _quantize_fp8(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, MAX: tl.constexpr, INV_MAX: tl.constexpr,
                      TINY: tl.constexpr, BLOCK: tl.constexpr):
        """Row b: scale = max(amax, TINY) * INV_MAX, q = x / scale in e4m3 (clamped to +-MAX). Two passes
        over the row in BLOCK chunks (the second reads it from L2): a whole 18944-wide row in one
        block took ~500 us at 8192 rows on an H200, the chunks ~134 us."""
        b = tl.program_id(0).to(tl.int64)
        x_row, q_row = x_ptr + b * stride_x, q_ptr + b * stride_q
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0), TINY) * INV_MAX
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -MAX), MAX)
            tl.store(q_row + cols, q.to(tl.float8e4nv), mask=cols < K)
        tl.store(scale_ptr + b, scale)


def quantize_fp8(x: torch.Tensor, max_value: float, inv_max: float, tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] in e4m3, its row scales [M, 1] float32): row m is q[m] * scale[m], scale = the row's
    absolute maximum (at least `tiny`) * `inv_max`, q clamped to +-`max_value`."""
    M, K = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, device=x.device)
    _quantize_fp8[(M,)](x, q, scale, K, x.stride(0), q.stride(0), MAX=max_value, INV_MAX=inv_max, TINY=tiny,
                        BLOCK=min(4096, triton.next_power_of_2(K)), num_warps=4)
    return q, scale


def instead(kernel: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function runs `kernel` where the kernels run (`available` for its first
    argument), and itself elsewhere."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(x: torch.Tensor, *args: Any) -> Any:
            return kernel(x, *args) if available(x) else fn(x, *args)
        return call
    return wrap


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [rows, last dim] with unit stride along it: a view where one exists, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed rows, x + residual); without a residual, the second is the first, not written twice."""
    N = x.shape[-1]
    assert weight.dtype == x.dtype and weight.is_contiguous(), "the kernel scales by a weight of the input's dtype"
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    res = _rows(residual) if residual is not None else rows
    block = triton.next_power_of_2(N)
    _rms_norm[(len(rows),)](rows, res, weight, out, total, N, rows.stride(0), res.stride(0), N, N, eps,
                            ADD=residual is not None, BLOCK=block, num_warps=min(8, max(1, block // 256)))
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engine/rollout/model.rms_norm over the last dimension, one program per row."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """engine/rollout/model.add_rms_norm: (rms_norm(x + residual), x + residual)."""
    return _norm(x, residual, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """engine/rollout/model.rope: q [B, S, H, D] and k [B, S, KV, D], any strides but a unit one
    along D; cos and sin [B, S, 1, D]. One launch rotates both, one program per token and tensor."""
    B, S, H, D = q.shape
    KV = k.shape[2]
    assert q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1 and cos.stride() == sin.stride()
    cos, sin = cos.expand(B, S, 1, D), sin.expand(B, S, 1, D)  # a size-1 batch is read at stride 0
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _rope[(B * S, 2)](q, k, q_out, k_out, cos, sin, S, H, KV, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
                      k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
                      HP=triton.next_power_of_2(max(H, KV)), HALF=D // 2)
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """engine/rollout/model.silu_mul: silu(first half of the last dimension) * second half."""
    N = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], N, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(N))
    _silu_mul[(len(rows), triton.cdiv(N, block))](rows, out, N, rows.stride(0), N, BLOCK=block)
    return out


# programs per SM a decode attention aims for: below it, a row over _SPAN columns splits over several
_PROGRAMS_PER_SM, _SPAN = 4, 1024
_counts: dict[torch.device, torch.Tensor] = {}  # per device: the split pieces' tallies (see decode_attention)


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, kv_lens: torch.Tensor, splits: int | None = None,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention, row i on cache slot i: write this step's k_new, v_new [B, KV, D]
    at column kv_lens[i] of the slot's cache k, v [slots >= B, KV, L, D] (head-major, as
    engine/rollout/model.KVCache holds one layer), then attend q [B, H, D] over the slot's first
    kv_lens[i] + 1 columns; out [B, H, D]. Given the RoPE tables `cos` and `sin` [positions > kv_lens,
    D], q and k_new are rotated first, row i at position kv_lens[i] (engine/rollout/model.rope), in
    the same launch.

    With fewer (row, KV head) pairs than the GPU runs programs at once (the long tail of a step), a
    row over `_SPAN` columns goes over up to `splits` programs (default: enough to fill the GPU),
    each a piece of its columns; the last piece to finish combines them (flash-decoding). Otherwise
    one program runs the row, column block after column block. The pieces count themselves in a
    tally per device, so two calls on one device must not run at once (on two streams)."""
    B, H, D = q.shape
    KV = k.shape[1]
    assert k.stride() == v.stride() and all(t.stride(-1) == 1 for t in (q, k_new, v_new, k))
    rotate = cos is not None and sin is not None
    if cos is None or sin is None:
        cos = sin = q  # pointers the kernel never reads
    else:
        assert cos.shape == sin.shape and cos.shape[1] == D and cos.stride() == sin.stride() and cos.stride(1) == 1
    out = torch.empty_like(q)
    G = H // KV
    GP = max(16, triton.next_power_of_2(G))
    programs = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(q.device).multi_processor_count
    if splits is None:
        splits = 1 << max(0, min(4, (programs // (B * KV)).bit_length() - 1))  # a power of 2, at most 16
    counts = _counts.get(q.device)
    if counts is None:  # made once, never replaced: a CUDA graph keeps its address; each call leaves it zeroed
        counts = _counts[q.device] = torch.zeros(programs, dtype=torch.int32, device=q.device)
    pieces = B * KV * splits * GP if splits > 1 else 1
    if splits > 1 and B * KV > len(counts):
        raise ValueError(f"{B} rows x {KV} KV heads is too many to split over {splits} programs each")
    part = torch.empty(pieces * (D + 2), dtype=torch.float32, device=q.device)
    _attend[(B, KV, splits)](q, k_new, v_new, k, v, kv_lens, out, part, part[pieces:], part[2 * pieces:], counts,
                             cos, sin, D ** -0.5, q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
                             v_new.stride(0), v_new.stride(1), k.stride(0), k.stride(1), k.stride(2), out.stride(0),
                             out.stride(1), cos.stride(0),
                             G=G, GP=GP, D=D, BLOCK_N=64, SPLITS=splits, SPAN=_SPAN, ROTATE=rotate)
    return out


def categorical_sample(logits: torch.Tensor, inv_t: torch.Tensor,
                       uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) drawn from softmax(logits [B, V] * inv_t) by inverting its CDF at
    each row's `uniform` [B] in [0, 1): the chunk whose cumulative mass passes it, then the token
    inside. `inv_t` is 1/temperature as a one-element float32 tensor on the device, read by the
    kernels, so a CUDA graph of this serves any temperature; no host sync anywhere."""
    B, V = logits.shape
    assert logits.stride(-1) == 1 and uniform.is_contiguous()
    block, device = 4096, logits.device
    chunks = triton.cdiv(V, block)
    top, total = torch.empty(B, chunks, device=device), torch.empty(B, chunks, device=device)
    _chunk_mass[(B, chunks)](logits, top, total, V, logits.stride(0), inv_t, BLOCK=block)
    tokens, logprobs = torch.empty(B, dtype=torch.long, device=device), torch.empty(B, device=device)
    _pick[(B,)](logits, top, total, uniform, tokens, logprobs, V, logits.stride(0), inv_t, chunks,
                CP=triton.next_power_of_2(chunks), BLOCK=block)
    return tokens, logprobs

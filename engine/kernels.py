"""Triton kernels for the native engine's decode step on CUDA, where library kernels fall short.

Measured on one H200 (torch 2.11), Qwen2.5-0.5B shape, 256 rows over a 384-column KV cache about
two-thirds live, per layer: the written-out attention (engine/native_model.py) 33 us, PyTorch's
flash kernel with per-row lengths (`aten._flash_attention_forward(seqused_k=)`) 39 us, flex
attention's decoding 217 us, against a floor of 7 us to read the live K/V once. The flash
kernel runs each query head on its own and so reads every K/V head once per query head; and
sampling compiled by inductor took 233 us to read 78 MB of logits (a 16 us floor).

- `decode_attention`: one program per (row, KV head) writes the step's K/V into the cache and runs
  that head's G query heads together over the row's live cache columns only, with an online
  softmax (the two cache writes were kernels of their own, ~4 us each).
- `gumbel_sample`: a draw from softmax(logits / T) by the Gumbel-max trick, the noise made in the
  kernel (Philox, from one seed drawn from the caller's generator), over the vocabulary in
  chunks; a few small torch ops combine the chunks' argmax and log-sum-exp.

Invariants:
- the same math as the eager paths (engine/native_model.decode_attention, engine/native.gumbel_pick)
  up to rounding: fp32 scores and softmax;
- the same seed gives the same samples; randomness comes only from the caller's generator.
`RLFLOW_TRITON=0` switches both off (the eager paths run instead), e.g. to compare.

Run: python -m pytest -m gpu tests/engine/test_kernels.py
"""

from __future__ import annotations

import os

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
    def _attend(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, lens_ptr, out_ptr, scale, sq_b, sq_h, skn_b, skn_h,
                svn_b, svn_h, sk_b, sk_h, sk_n, so_b, so_h,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        cached = tl.load(lens_ptr + b)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        heads = (h * G + g)[:, None]
        q = tl.load(q_ptr + b * sq_b + heads * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
        k_row, v_row = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sk_b + h * sk_h
        # this step's K/V: into the cache for later steps, and straight into the softmax's start
        k_new = tl.load(kn_ptr + b * skn_b + h * skn_h + d)
        v_new = tl.load(vn_ptr + b * svn_b + h * svn_h + d)
        tl.store(k_row + cached * sk_n + d, k_new)
        tl.store(v_row + cached * sk_n + d, v_new)
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # [GP]
        total = tl.full([GP], 1.0, tl.float32)
        acc = tl.zeros([GP, D], tl.float32) + v_new.to(tl.float32)[None, :]
        for start in range(0, cached, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            live = cols < cached
            k = tl.load(k_row + cols[:, None] * sk_n + d[None, :], mask=live[:, None], other=0.0)
            s = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # [GP, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_row + cols[:, None] * sk_n + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            total = total * alpha + tl.sum(p, 1)
            m = m_new
        out = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * so_b + heads * so_h + d[None, :], out, mask=(g < G)[:, None])

    @triton.jit
    def _gumbel_chunks(logits_ptr, seed_ptr, best_ptr, where_ptr, max_ptr, sum_ptr, V, stride, inv_t,
                       BLOCK: tl.constexpr):
        b, c = tl.program_id(0), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + b * stride + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        u = tl.rand(tl.load(seed_ptr), b * V + cols)  # uniform [0, 1), one counter per (row, token)
        perturbed = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
        top = tl.max(x, 0)
        out = b * tl.num_programs(1) + c
        tl.store(best_ptr + out, tl.max(perturbed, 0))
        tl.store(where_ptr + out, c * BLOCK + tl.argmax(perturbed, 0))
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - top), 0))


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """One decode step's attention, row i on cache slot i: write this step's k_new, v_new [B, KV, D]
    at column kv_lens[i] of the slot's cache k, v [slots >= B, KV, L, D] (head-major, as
    engine/native_model.KVCache holds one layer), then attend q [B, H, D] over the slot's first
    kv_lens[i] + 1 columns; out [B, H, D]."""
    B, H, D = q.shape
    KV = k.shape[1]
    assert k.stride() == v.stride() and all(t.stride(-1) == 1 for t in (q, k_new, v_new, k))
    out = torch.empty_like(q)
    G = H // KV
    _attend[(B, KV)](q, k_new, v_new, k, v, kv_lens, out, D ** -0.5, q.stride(0), q.stride(1), k_new.stride(0),
                     k_new.stride(1), v_new.stride(0), v_new.stride(1), k.stride(0), k.stride(1), k.stride(2),
                     out.stride(0), out.stride(1), G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=64)
    return out


def gumbel_sample(logits: torch.Tensor, temperature: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) drawn from softmax(logits [B, V] / temperature)."""
    B, V = logits.shape
    if B * V >= 2 ** 31:
        raise ValueError(f"{B} rows x {V} tokens overflow the sampler's 32-bit noise counter")
    assert logits.stride(-1) == 1
    block = 4096
    chunks = triton.cdiv(V, block)
    seed = torch.randint(2 ** 31 - 1, (1,), generator=generator, device=logits.device)
    best, top, total = (torch.empty(B, chunks, device=logits.device) for _ in range(3))
    where = torch.empty(B, chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunks[(B, chunks)](logits, seed, best, where, top, total, V, logits.stride(0), 1.0 / temperature,
                                BLOCK=block)
    tokens = where.gather(-1, best.argmax(-1, keepdim=True)).long()  # [B, 1]
    peak = top.amax(-1, keepdim=True)
    lse = peak[:, 0] + (total * (top - peak).exp()).sum(-1).log()
    return tokens[:, 0], logits.gather(-1, tokens)[:, 0].float() / temperature - lse

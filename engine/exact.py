"""Deterministic mode's arithmetic (`trainer.deterministic`): a token's numbers come out of the
same operations in the same order whatever else shares its batch, so the rollout engine and the
trainer, which batch the same token differently, compute its logprob bit for bit alike.

Three operations change with the batch in PyTorch's own kernels, and have a form here that does not:
- a matrix product: a BLAS picks its blocking and its kernel by the number of rows (a row of
  `F.linear` changes in its last bits between 1 and 17 rows on the CPU); `linear` multiplies each
  row alone, [1, K] x [K, N], as one batched product over rows, so every row takes one path;
- attention: `attend` runs one query against its own keys (k, v [KV, n, D], n its position + 1),
  as products and sums whose order depends on n alone; `causal` runs a sequence's queries so;
- the log-softmax over the vocabulary: per row already (`algos.token_logprobs`).
Norms, RoPE and gating act within one token's vector, in transformers' order on both sides (the
engine's model mirrors transformers' numerics). The rest is elementwise.

Where it holds: the CPU, in float32, one thread a process (a reduction that threads split
depends on the shape), the native engine against the trainer's HF model, full weights (a LoRA
forward adds its adapters after the base product; the engine takes them merged), tp and sp 1.

Invariant: `linear(x)[i]`, `attend` and `causal(...)[i]` depend only on row or query i's inputs.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

NAME = "rlflow_exact"  # transformers' attn_implementation of the trainer's model in this mode


class _PerRow(torch.autograd.Function):
    """Forward row by row; backward as plain products: only the forward's numbers must not depend
    on the batch, and autograd through the expanded weight would hold a [M, K, N] gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        rows = x.reshape(-1, 1, x.shape[-1])  # [M, 1, K]
        return torch.bmm(rows, weight.t().expand(rows.shape[0], -1, -1)).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        g = grad.reshape(-1, weight.shape[0])  # [M, N]
        return ((g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None,  # type: ignore[attr-defined]
                g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None)  # type: ignore[attr-defined]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T [K, N] (+ bias), each row its own [1, K] x [K, N] product."""
    out = _PerRow.apply(x, weight)
    return out if bias is None else out + bias


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One query q [H, D] against its keys k, v [KV, n, D] (grouped: H = KV x G) -> [H, D]."""
    kv, n, d = k.shape
    qg = q.view(kv, -1, 1, d)  # [KV, G, 1, D]
    scores = (qg * k[:, None]).sum(-1) * scale  # [KV, G, n]
    probs = scores.float().softmax(-1).to(v.dtype)
    return (probs[..., None] * v[:, None]).sum(-2).reshape(-1, d)  # [KV, G, D] -> [H, D]


def causal(q: Tensor, k: Tensor, v: Tensor, scale: float, start: int = 0) -> Tensor:
    """A sequence's queries q [S, H, D] at positions start..start+S-1 against its keys k, v
    [KV, start+S, D], each over the keys up to its own position -> [S, H, D]."""
    return torch.stack([attend(q[s], k[:, :start + s + 1], v[:, :start + s + 1], scale) for s in range(q.shape[0])])


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, self.weight, self.bias)


def per_row(model: nn.Module) -> nn.Module:
    """`model` (a transformers model) with every `nn.Linear` multiplying row by row (`linear`);
    its attention is the attn_implementation `NAME` (engine/train/varlen.py registers it)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
    return model

"""Compact causal LM for the Qwen2 / Qwen2.5 / Qwen3 / Llama families, with a slot KV cache.

Built from a HF `config.json`; module names mirror transformers' so HF parameter names map 1:1,
except the two fused projections (`qkv_proj`, `gate_up_proj`). Tensor parallel over `TP.size`
ranks: the fused projections are column parallel, `o_proj`/`down_proj` row parallel (summed by an
all-reduce), the rest replicated. Each split layer has a `cut(shape, shard)` method saying which
piece of a full HF tensor this rank keeps and where it lands (a `Cut`): layout knowledge sits
next to the layer that owns it. Loading from full tensors and resharding from training shards
(engine/reshard.py) both read it.

Invariants:
- `forward` without a cache is a plain causal forward over right-padded rows;
- prefill writes rows' K/V into `cache[:, slot, :, :S]`; decode runs row i on slot i, writes one
  token at `cache[:, i, :, kv_len]` and attends over the slot's first `kv_len + 1` positions;
- RMSNorm and RoPE follow transformers' numerics (float32 norm, rotate-half RoPE);
- built with `quantize=True` (`rollout.dtype=fp8`), the decoder's projections keep their weights in
  float8 e4m3 with a float32 scale per output row (engine/rollout/fp8.py), quantised whenever
  weights are written (`load`, engine/reshard.py); every other parameter is bf16;
- `exact()` (deterministic mode, engine/exact.py): each token's numbers as transformers' model
  computes them under the same mode, bit for bit, whatever its batch: each projection of a fused
  pair alone and each row alone, each token's attention over its own cached keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from rlflow.engine import exact
from rlflow.engine.rollout import fp8, kernels
from rlflow.engine.tensors import consecutive_group, fused
from rlflow.engine.vmm import StableBuffer

SUPPORTED = ("qwen2", "qwen3", "llama")
# HF name piece -> (fused module name, shard id)
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


@dataclass(frozen=True)
class TP:
    """This process's place in a tensor-parallel group (size 1 = no parallelism)."""
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed group; None = the default group

    @classmethod
    def over_world(cls, size: int) -> TP:
        """This rank's place when the default group splits into TP groups of `size` consecutive
        ranks; collective: every rank makes every group, in the same order."""
        if size == 1:
            return cls()
        return cls(torch.distributed.get_rank() % size, size, consecutive_group(size))


@dataclass(frozen=True)
class Cut:
    """This rank's piece of a full HF tensor and where it lands: `full.narrow(dim, start, length)`
    (the whole tensor when `dim` is None) is written to the parameter's rows from `row` on; `zero`
    writes zeros there instead (a row-parallel bias off TP rank 0)."""
    dim: int | None = None
    start: int = 0
    length: int = 0
    row: int = 0
    zero: bool = False

    def source(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)


def load(param: torch.Tensor, full: torch.Tensor, cut: Cut, scale: torch.Tensor | None = None) -> None:
    """Write `cut`'s piece of the full HF tensor into `param`; into an fp8 weight, quantised, with
    its rows' scales into `scale` [N]."""
    src = cut.source(full)
    dst = param.narrow(0, cut.row, src.shape[0]) if param.dim() else param
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit parameter {tuple(param.shape)} at row {cut.row}")
    if scale is not None:
        fp8.quantize_into(dst, scale.narrow(0, cut.row, src.shape[0]), src)
    else:
        dst.zero_() if cut.zero else dst.copy_(src)


def fp8_weight(layer: nn.Linear) -> None:
    """Keep `layer`'s weight [N, K] in float8 e4m3, its scales [N] beside it (`weight_scale`); on the
    meta device, before `materialize`. No bf16 copy is kept: the memory and the bytes each decode
    step reads are what fp8 is for, and the trainer's weights, sent again at every sync, are the
    source of truth (the engine never needs to quantise anew from its own copy)."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(w.shape, dtype=fp8.FP8, device=w.device), requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.empty(w.shape[0], device=w.device), requires_grad=False)


def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s x @ weight.T + bias; an fp8 GEMM where `fp8_weight` made the weight fp8."""
    if layer.weight.dtype != fp8.FP8:
        return F.linear(x, layer.weight, layer.bias)
    scale: torch.Tensor = layer.weight_scale  # type: ignore[assignment]  # an attribute fp8_weight set
    return fp8.linear(x, layer.weight, scale, layer.bias)


class FusedLinear(nn.Linear):
    """Column parallel: several HF projections of the same input, each split along its output
    dim over the TP ranks, this rank's pieces stacked into one matmul (deterministic: one each,
    as transformers' separate projections)."""

    exact = False

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, tp: TP) -> None:
        super().__init__(in_features, sum(shards.values()) // tp.size, bias=bias)
        self.tp = tp
        self.sizes = [size // tp.size for size in shards.values()]
        self.offsets, start = {}, 0
        for name, size in zip(shards, self.sizes):
            self.offsets[name] = start
            start += size

    def cut(self, shape: torch.Size, shard: str | None) -> Cut:
        """This rank's rows of projection `shard` (weight or bias), at that projection's offset."""
        assert shard is not None, "a fused projection needs its shard name"
        rows = shape[0] // self.tp.size
        return Cut(0, self.tp.rank * rows, rows, self.offsets[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(self.sizes)
            return torch.cat([exact.linear(x, w, b) for w, b in zip(self.weight.split(self.sizes), biases)], -1)
        return project(self, x)


class RowLinear(nn.Linear):
    """Row parallel: the input dim split over the TP ranks, partial outputs summed by all-reduce."""

    exact = False

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP) -> None:
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def cut(self, shape: torch.Size, shard: str | None = None) -> Cut:
        """The weight's columns of this rank; the bias whole on rank 0 and zero elsewhere, so the
        all-reduce adds it once."""
        if len(shape) == 2:
            cols = shape[1] // self.tp.size
            return Cut(1, self.tp.rank * cols, cols)
        return Cut(zero=self.tp.rank != 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = exact.linear(x, self.weight, self.bias) if self.exact else project(self, x)
        if self.tp.size > 1:
            torch.distributed.all_reduce(out, group=self.tp.group)
        return out


@kernels.instead(kernels.rms_norm)
@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' numerics: normalize in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@kernels.instead(kernels.add_rms_norm)
@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused into the next norm."""
    h = x + residual
    f = h.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype), h


@kernels.instead(kernels.rope)
@fused
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on q [B, S, H, D] and k [B, S, KV, D]; cos/sin [B, S, 1, D]."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin
    return rotate(q), rotate(k)


@kernels.instead(kernels.silu_mul)
@fused
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


@fused
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [B, KV, G, D] over k, v [B, KV, W, D] with additive mask [B, 1, 1, W].

    Written out (two batched matmuls around one fused mask+softmax) so CPU and CUDA run the same
    math; on an H200 at 256 rows it costs what cuDNN's fused kernel did (~31 us a layer)."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + mask
    return scores.softmax(-1).to(v.dtype) @ v


def decode_mask(kv_lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, W] for decode_attention: row i attends columns 0..kv_lens[i]. Built
    once per step in the compute dtype rather than converted in every layer."""
    cols = torch.arange(width, device=kv_lens.device)
    return torch.zeros((), dtype=dtype, device=kv_lens.device).masked_fill(
        cols[None, :] > kv_lens[:, None], float("-inf"))[:, None, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass
class AttnContext:
    """What attention needs beyond hidden states, built once per forward."""
    cos: torch.Tensor  # [B, S, D]; decode with the Triton kernel (no mask): the table [positions, D]
    sin: torch.Tensor  # as cos
    cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [B] cache slot of each row (prefill)
    start: int | torch.Tensor = 0  # prefill: tokens of these rows already in the cache (a later chunk of
    # a long prompt, all rows alike); a tensor [B]: per row (the history of a continued sequence)
    attend: int = 0  # continued rows: cache columns attended, past every row's last (0: read off start)
    kv_lens: torch.Tensor | None = None  # [B] tokens already cached (decode: row i is slot i)
    mask: torch.Tensor | None = None  # [B, 1, 1, W] additive: 0 attend, -inf not (decode; None:
    # the Triton kernel, which reads kv_lens itself)


class KVCache:
    """K and V as [layers, slots, kv_heads, max_len, head_dim]; a running sequence owns a slot.

    Head-major per slot, so decode attends over `k[layer, :B, :, :W]`, a view: no gather.
    `free` and `allocate` give the memory back and take it again, zeroed. On CUDA it lives in a
    `StableBuffer` (engine/vmm.py): it comes back at the same addresses, so the decode graphs
    that point into it stay valid. Elsewhere it is freed and allocated through torch."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (layers, slots, kv_heads, max_len, head_dim)
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.nbytes = torch.Size(self.shape).numel() * dtype.itemsize  # each of K and V
        self.buffer: StableBuffer | None = None
        if device.type == "cuda":
            self.buffer = StableBuffer(2 * self.nbytes, device)
        self.allocate()

    def allocate(self) -> None:
        if self.k is not None:
            return
        if self.buffer is None:
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            return
        self.buffer.restore()
        self.k = self.buffer.view(self.dtype, self.shape).zero_()
        self.v = self.buffer.view(self.dtype, self.shape, self.nbytes).zero_()

    def free(self) -> None:
        self.k = self.v = None
        if self.buffer is not None:
            self.buffer.release()


def head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


class Attention(nn.Module):
    exact = False

    def __init__(self, cfg: Any, layer: int, tp: TP) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        self.head_dim = head_dim(cfg)
        qkv_bias = True if cfg.model_type == "qwen2" else bool(getattr(cfg, "attention_bias", False))
        o_bias = False if cfg.model_type == "qwen2" else bool(getattr(cfg, "attention_bias", False))
        q, kv = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, qkv_bias, tp)
        self.o_proj = RowLinear(q, cfg.hidden_size, o_bias, tp)
        self.q_norm = self.k_norm = None
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, -1)
        q = q.view(B, S, self.heads, self.head_dim)
        k = k.view(B, S, self.kv_heads, self.head_dim)
        v = v.view(B, S, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.exact:
            q, k = rope(q, k, ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2))
            return self.o_proj(self._exact(q, k, v, ctx).reshape(B, S, -1))
        if ctx.kv_lens is not None:  # decode rotates q and k itself, inside the attention kernel
            return self.o_proj(self._decode(q, k, v, ctx).reshape(B, S, -1))
        q, k = rope(q, k, ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        mask: torch.Tensor | CausalBias | None = None
        if isinstance(ctx.start, torch.Tensor):  # rows continue after cached histories of their own lengths
            assert ctx.cache is not None and ctx.cache.k is not None and ctx.cache.v is not None, "KV cache released"
            assert ctx.slots is not None
            ck, cv = ctx.cache.k[self.layer], ctx.cache.v[self.layer]  # [slots, KV, L, D]
            cols = ctx.start[:, None] + torch.arange(S, device=q.device)  # [B, S]
            # a short row's padding lands past its end (clamped into the slot), where decode writes next
            at = (ctx.slots[:, None], slice(None), cols.clamp(max=ck.shape[2] - 1))
            ck[at], cv[at] = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, KV, D] at [B, S] -> (slot, col)
            # a short row's padding may run past the slot's end; read off `start`, it costs a sync a layer
            end = min(ctx.attend or int(cols.max()) + 1, ck.shape[2])
            k, v = ck[ctx.slots, :, :end], cv[ctx.slots, :, :end]
            mask = (torch.arange(end, device=q.device) <= cols[:, :, None])[:, None]  # [B, 1, S, end]
        elif ctx.cache is not None:  # prefill: this chunk goes into its slots after `start` cached tokens
            assert ctx.cache.k is not None and ctx.cache.v is not None, "KV cache released"
            end = ctx.start + S
            ctx.cache.k[self.layer, ctx.slots, :, ctx.start:end] = k
            ctx.cache.v[self.layer, ctx.slots, :, ctx.start:end] = v
            if ctx.start:  # a later chunk also attends over the cached prefix: causal, its rows the last
                k, v = ctx.cache.k[self.layer, ctx.slots, :, :end], ctx.cache.v[self.layer, ctx.slots, :, :end]
                mask = causal_lower_right(S, end)  # flash on CUDA; a [S, end] mask would run the math kernel
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

    def _exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """Deterministic mode: this call's K/V written where they belong (prefill, a later chunk, a
        continued row, decode), then each token attends over its own keys alone (`exact.attend`).
        q, k, v [B, S, heads, D] rotated -> [B, S, heads, D]."""
        B, S = q.shape[:2]
        scale = self.head_dim ** -0.5
        if ctx.cache is None:  # a plain causal forward over right-padded rows
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, KV, S, D]
            return torch.stack([exact.causal(q[b], keys[b], values[b], scale) for b in range(B)])
        assert ctx.cache.k is not None and ctx.cache.v is not None, "KV cache released"
        ck, cv = ctx.cache.k[self.layer], ctx.cache.v[self.layer]  # [slots, KV, L, D]
        if ctx.kv_lens is not None:  # decode: row i is slot i, its token at column kv_lens[i]
            slots, cols = torch.arange(B, device=q.device), ctx.kv_lens[:, None]
        else:
            assert ctx.slots is not None
            start = ctx.start if isinstance(ctx.start, torch.Tensor) else torch.full((B,), ctx.start, device=q.device)
            slots, cols = ctx.slots, start[:, None] + torch.arange(S, device=q.device)  # [B, S]
        cols = cols.clamp(max=ck.shape[2] - 1)  # a short row's padding, past its slot's end
        ck[slots[:, None], :, cols], cv[slots[:, None], :, cols] = k, v  # [B, S, KV, D] at (slot, col)
        ends = (cols + 1).tolist()
        return torch.stack([torch.stack([exact.attend(q[b, s], ck[slot, :, :end], cv[slot, :, :end], scale)
                                         for s, end in enumerate(ends[b])]) for b, slot in enumerate(slots.tolist())])

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """Rotate q and k, append row i's token to slot i at kv_lens[i]; attend over the slot's first
        W columns.

        The query heads that share a KV head ride as that head's "query positions", so attention
        needs neither a KV repeat nor a gather: q [B, KV, G, D] against the cache view [B, KV, W, D]."""
        assert ctx.cache is not None and ctx.cache.k is not None and ctx.cache.v is not None
        assert ctx.kv_lens is not None
        B = q.shape[0]
        ck, cv = ctx.cache.k[self.layer], ctx.cache.v[self.layer]  # [slots, KV, L, D]
        if ctx.mask is None:  # one kernel: RoPE, the cache write, then only each row's live columns
            return kernels.decode_attention(q[:, 0], k[:, 0], v[:, 0], ck, cv, ctx.kv_lens, cos=ctx.cos, sin=ctx.sin)
        q, k = rope(q, k, ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2))
        rows = torch.arange(B, device=q.device)
        ck[rows, :, ctx.kv_lens] = k[:, 0]
        cv[rows, :, ctx.kv_lens] = v[:, 0]
        W = ctx.mask.shape[-1]
        q = q.view(B, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        return decode_attention(q, ck[:B, :, :W], cv[:B, :, :W], ctx.mask)


class MLP(nn.Module):
    def __init__(self, cfg: Any, tp: TP) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": inter, "up": inter}, False, tp)
        self.down_proj = RowLinear(inter, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer: int, tp: TP) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn(h, ctx)
        norm = self.post_attention_layernorm
        h, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """Embeddings, norms and lm_head are replicated over TP ranks; attention and MLP are split."""

    def __init__(self, cfg: Any, tp: TP) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope_theta(cfg: Any) -> float:
    """The plain-RoPE base; other rope types are refused rather than silently mis-rotated."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"rope type '{kind}' is not supported by the native engine (plain RoPE only)")
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None)
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


def check_config(cfg: Any, tp: TP) -> None:
    if cfg.num_key_value_heads % tp.size or cfg.intermediate_size % tp.size:
        raise ValueError(f"tensor parallel size {tp.size} must divide num_key_value_heads "
                         f"({cfg.num_key_value_heads}) and intermediate_size ({cfg.intermediate_size})")
    if cfg.model_type not in SUPPORTED:
        raise NotImplementedError(f"model_type '{cfg.model_type}' is not supported; native supports {SUPPORTED}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act '{cfg.hidden_act}' is not supported (silu only)")
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported")
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError("mlp_bias is not supported")


class NativeCausalLM(nn.Module):
    def __init__(self, cfg: Any, tp: TP = TP(), quantize: bool = False) -> None:
        super().__init__()
        check_config(cfg, tp)
        self.config, self.tp = cfg, tp
        self.kv_heads = cfg.num_key_value_heads // tp.size  # this rank's, as its KV cache holds
        self.model = Backbone(cfg, tp)
        if quantize:  # fp8: the decoder's projections alone. The embedding is a lookup and the norms are
            # tiny; the lm_head's logits are what sampling and the logprobs read, so it stays bf16 too
            for layer in self.model.layers.modules():
                if isinstance(layer, (FusedLinear, RowLinear)):
                    fp8_weight(layer)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_dim = head_dim(cfg)
        self.rope_theta = rope_theta(cfg)
        # inference only: a forward outside inference_mode (graph capture) must not record autograd
        # history, which would keep every captured step's activations alive
        self.requires_grad_(False)
        self.weights: StableBuffer | None = None  # on CUDA, where `materialize` put every parameter
        self.writes = 0  # how many times the weights were (re)written: a KV cache made before is stale
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # `_rope_table`
        self.deterministic = False  # `exact()`

    def materialize(self, device: str | torch.device, dtype: torch.dtype) -> NativeCausalLM:
        """Uninitialised storage in `dtype` for a model built on the meta device (fp8 weights and
        their scales, `fp8_weight`'s, keep their own dtypes). On CUDA every parameter lies in one
        StableBuffer (engine/vmm.py), so `release_weights` can give the memory back while
        training runs, and the next write takes it again at the same addresses, which the decode
        graphs hold."""
        device = torch.device(device)
        named = [(name, p, p.dtype if p.dtype == fp8.FP8 or name.endswith("weight_scale") else dtype)
                 for name, p in self.named_parameters()]  # a tied head's weight once
        if device.type != "cuda":
            if not any(p.dtype == fp8.FP8 for _, p, _ in named):
                return self.to_empty(device=device).to(dtype)
            for name, p, kind in named:  # `.to(dtype)` would cast the fp8 weights and their scales too
                owner, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(owner), leaf,
                        nn.Parameter(torch.empty(p.shape, dtype=kind, device=device), requires_grad=False))
            return self
        sizes = [-(-p.numel() * kind.itemsize // 512) * 512 for _, p, kind in named]  # each 512-byte aligned
        self.weights = StableBuffer(sum(sizes), device)
        at = 0
        for (name, p, kind), n in zip(named, sizes):  # new Parameters: a meta tensor's storage cannot be swapped
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, nn.Parameter(self.weights.view(kind, tuple(p.shape), at),
                                                                  requires_grad=False))
            at += n
        return self

    def exact(self) -> NativeCausalLM:
        """Deterministic mode (engine/exact.py): every projection, attention and the lm_head
        computed per token, as the trainer's model computes them in that mode. Eager only: the
        engine runs no CUDA graphs or Triton kernels with it, and one tensor-parallel rank."""
        if self.tp.size > 1 or self.weights is not None or any(
                p.dtype == fp8.FP8 for p in self.parameters()):
            raise RuntimeError("deterministic mode runs on the CPU, on one tensor-parallel rank, without fp8")
        self.deterministic = True
        for m in self.modules():
            if isinstance(m, (FusedLinear, RowLinear, Attention)):
                m.exact = True
        return self

    def release_weights(self) -> None:
        """Give the parameters' memory back (CUDA; elsewhere nothing happens). Their values are
        lost until the next `load_weights` or reshard writes them all."""
        if self.weights is not None:
            self.weights.release()

    @property
    def weights_lost(self) -> bool:
        """Released and not written since (only a writer maps them again): `generate` must refuse."""
        return self.weights is not None and not self.weights.mapped

    def writing_weights(self) -> None:
        """A writer of every parameter starts: map their memory again if it was released."""
        self.writes += 1
        if self.weights is not None:
            self.weights.restore()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", tp: TP = TP()) -> NativeCausalLM:
        """Build from a HF directory: config via AutoConfig, weights (this rank's shards) from its
        safetensors files. `dtype` float8_e4m3fn: fp8 projections, bf16 elsewhere (`fp8_weight`)."""
        from safetensors import safe_open
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        dtype = dtype or getattr(cfg, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        with torch.device("meta"):  # no random init, no full-precision copy on the device
            model = cls(cfg, tp, quantize=dtype == fp8.FP8)
        model = model.materialize(device, fp8.WIRE if dtype == fp8.FP8 else dtype)
        loaded: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                loaded |= model.load_weights((name, st.get_tensor(name)) for name in st.keys())
        missing = set(dict(model.named_parameters())) - loaded
        if missing:
            raise ValueError(f"{path} lacks weights for {sorted(missing)}")
        return model

    @classmethod
    def from_module(cls, module: nn.Module, tp: TP = TP(), dtype: torch.dtype | None = None) -> NativeCausalLM:
        """A copy (this rank's shards) of a live HF causal LM, e.g. the trainer's, on its device
        and in its dtype (or `dtype`, as `from_pretrained` takes it)."""
        weight = next(module.parameters())
        dtype = dtype or weight.dtype
        with torch.device("meta"):
            model = cls(module.config, tp, quantize=dtype == fp8.FP8)
        model = model.materialize(weight.device, fp8.WIRE if dtype == fp8.FP8 else dtype)
        missing = set(dict(model.named_parameters())) - model.load_weights(module.named_parameters())
        if missing:
            raise ValueError(f"the module lacks weights for {sorted(missing)}")
        return model

    def place(self, hf_name: str, shape: torch.Size) -> tuple[str, Cut] | None:
        """Which parameter a full HF tensor feeds and this rank's cut of it; None for tensors the
        model does not keep (rotary buffers, a tied lm_head)."""
        if "rotary_emb" in hf_name or (self.tied and hf_name == "lm_head.weight"):
            return None
        parts = hf_name.split(".")
        i = next((i for i, p in enumerate(parts) if p in PACKED), None)
        shard = None
        if i is not None:
            parts[i], shard = PACKED[parts[i]]
        cut = getattr(self.get_submodule(".".join(parts[:-1])), "cut", None)
        return ".".join(parts), (cut(shape, shard) if cut else Cut())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors in, each cut to this rank's piece by its layer (fused and
        tensor-parallel layers), an fp8 weight quantised with its scales; returns the parameter
        names written."""
        self.writing_weights()
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for hf_name, tensor in named_tensors:
                placed = self.place(hf_name, tensor.shape)
                if placed is not None:
                    name, scale = placed[0], params.get(placed[0] + "_scale")  # weight -> weight_scale
                    load(params[name], tensor, placed[1], scale)
                    loaded |= {name, name + "_scale"} if scale is not None else {name}
        return loaded

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, start: int | torch.Tensor = 0, attend: int = 0) -> torch.Tensor:
        """Final hidden states [B, S, H] for ids/positions [B, S]: a causal forward over
        right-padded rows, which also writes each row's K/V into cache slot `slots[i]` (prefill),
        after `start` tokens already cached there (chunked prefill), or `start[i]` for row i (a
        sequence continued after its cached history)."""
        return self._run(ids, AttnContext(*self._rope(positions), cache, slots, start=start, attend=attend))

    def decode(self, ids: torch.Tensor, kv_lens: torch.Tensor, cache: KVCache, width: int) -> torch.Tensor:
        """One token per row, row i being cache slot i: ids and kv_lens [B] -> hidden [B, H].

        Attends over the first `width` cached columns; a row whose slot is idle (kv_len 0) only
        scribbles on its own column 0, which the next prefill of that slot overwrites."""
        weight = self.model.embed_tokens.weight
        if kernels.available(weight):  # the Triton kernel reads each row's RoPE and live columns itself
            ctx = AttnContext(*self._rope_table(cache.shape[3], kv_lens.device), cache, kv_lens=kv_lens)
        else:  # the written-out attention needs the rows' cos/sin and a mask
            mask = decode_mask(kv_lens, width, weight.dtype)
            ctx = AttnContext(*self._rope(kv_lens[:, None]), cache, kv_lens=kv_lens, mask=mask)
        return self._run(ids[:, None], ctx)[:, 0]

    def _rope_table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [length, D] of positions 0..length-1, made once per length and kept: the decode
        graphs read them where they were at capture."""
        if (length, device) not in self._tables:
            self._tables[(length, device)] = self._rope(torch.arange(length, device=device))
        return self._tables[(length, device)]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, S, D] in the weights' dtype, computed in float32 as transformers does."""
        dims = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device).float()
        inv_freq = 1.0 / (self.rope_theta ** (dims / self.head_dim))
        freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), -1)
        dtype = self.model.embed_tokens.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, ids: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x, residual = self.model.embed_tokens(ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        norm = self.model.norm
        return add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.deterministic:
            return exact.linear(hidden, weight)
        return F.linear(hidden, weight)  # [B, V] in the weights' dtype; sampling upcasts

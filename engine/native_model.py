"""Compact causal LM for the Qwen2 / Qwen2.5 / Qwen3 / Llama families, with a slot KV cache.

Built from a HF `config.json`; module names mirror transformers' so HF parameter names map 1:1,
except the two fused projections (`qkv_proj`, `gate_up_proj`). Each fused layer has a
`weight_loader(param, tensor, shard)` (a method, so it survives `.to()` and `to_empty`) that
knows which rows a HF tensor fills: layout knowledge sits next to the layer that owns it.

Invariants:
- `forward` without a cache is a plain causal forward over right-padded rows;
- prefill writes rows' K/V into `cache[:, slot, :S]`; decode writes one token at
  `cache[:, slot, kv_len]` and attends over the slot's first `kv_len + 1` positions;
- RMSNorm and RoPE follow transformers' numerics (float32 norm, rotate-half RoPE).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("qwen2", "qwen3", "llama")
# HF name piece -> (fused module name, shard id)
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def default_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit parameter {tuple(param.shape)}")
    param.copy_(tensor)


class FusedLinear(nn.Linear):
    """Several HF projections of the same input stacked along the output dim (one matmul)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.sizes = list(shards.values())
        self.offsets, start = {}, 0
        for name, size in shards.items():
            self.offsets[name] = (start, start + size)
            start += size

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        """Copy a HF tensor (weight or bias of projection `shard`) into its rows of `param`."""
        start, end = self.offsets[shard]
        default_loader(param.data[start:end], tensor)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass
class AttnContext:
    """What attention needs beyond hidden states, built once per forward."""
    cos: torch.Tensor  # [B, S, D]
    sin: torch.Tensor  # [B, S, D]
    cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [B] cache slot of each row
    kv_lens: torch.Tensor | None = None  # [B] tokens already cached (decode); None = prefill
    mask: torch.Tensor | None = None  # [B, 1, 1, W] bool, True = attend (decode)


class KVCache:
    """K and V as [layers, slots, max_len, kv_heads, head_dim]; a running sequence owns a slot."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (layers, slots, max_len, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.allocate()

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def free(self) -> None:
        self.k = self.v = None


def head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Attention(nn.Module):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        qkv_bias = True if cfg.model_type == "qwen2" else bool(getattr(cfg, "attention_bias", False))
        o_bias = False if cfg.model_type == "qwen2" else bool(getattr(cfg, "attention_bias", False))
        kv = self.kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.heads * self.head_dim, "k": kv, "v": kv}, qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=o_bias)
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
        cos, sin = ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2)  # [B, S, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if ctx.cache is None or ctx.kv_lens is None:
            if ctx.cache is not None:  # prefill: the prompt goes into its slot; attention is local
                assert ctx.cache.k is not None and ctx.cache.v is not None, "KV cache released"
                ctx.cache.k[self.layer, ctx.slots, :S] = k
                ctx.cache.v[self.layer, ctx.slots, :S] = v
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
        else:  # decode: append one token per row, attend over the slot prefix
            assert ctx.cache.k is not None and ctx.cache.v is not None and ctx.mask is not None
            ck, cv = ctx.cache.k[self.layer], ctx.cache.v[self.layer]
            ck[ctx.slots, ctx.kv_lens] = k[:, 0]
            cv[ctx.slots, ctx.kv_lens] = v[:, 0]
            W = ctx.mask.shape[-1]
            keys, vals = ck[ctx.slots, :W], cv[ctx.slots, :W]  # [B, W, KV, D]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                               attn_mask=ctx.mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": inter, "up": inter}, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
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


def check_config(cfg: Any) -> None:
    if cfg.model_type not in SUPPORTED:
        raise NotImplementedError(f"model_type '{cfg.model_type}' is not supported; native supports {SUPPORTED}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act '{cfg.hidden_act}' is not supported (silu only)")
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported")
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError("mlp_bias is not supported")


class NativeCausalLM(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        check_config(cfg)
        self.config = cfg
        self.model = Backbone(cfg)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_dim = head_dim(cfg)
        self.rope_theta = rope_theta(cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> NativeCausalLM:
        """Build from a HF directory: config via AutoConfig, weights from its safetensors files."""
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
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        loaded: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                loaded |= model.load_weights((name, st.get_tensor(name)) for name in st.keys())
        missing = set(dict(model.named_parameters())) - loaded
        if missing:
            raise ValueError(f"{path} lacks weights for {sorted(missing)}")
        return model

    @classmethod
    def from_module(cls, module: nn.Module) -> NativeCausalLM:
        """A copy of a live HF causal LM (e.g. the trainer's), on its device and in its dtype."""
        weight = next(module.parameters())
        with torch.device("meta"):
            model = cls(module.config)
        model = model.to_empty(device=weight.device).to(weight.dtype)
        missing = set(dict(model.named_parameters())) - model.load_weights(module.named_parameters())
        if missing:
            raise ValueError(f"the module lacks weights for {sorted(missing)}")
        return model

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (fused parameters take their shard through `weight_loader`);
        returns the names of the parameters written."""
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                    continue  # recomputed / shared with embed_tokens
                parts = name.split(".")
                i = next((i for i, p in enumerate(parts) if p in PACKED), None)
                if i is None:
                    default_loader(params[name], tensor)
                    loaded.add(name)
                    continue
                target, shard = PACKED[parts[i]]
                name = ".".join([*parts[:i], target, *parts[i + 1:]])
                fused = self.get_submodule(".".join([*parts[:i], target]))
                assert isinstance(fused, FusedLinear)
                fused.weight_loader(params[name], tensor, shard)
                loaded.add(name)
        return loaded

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
                kv_width: int = 0) -> torch.Tensor:
        """Final hidden states [B, S, H] for ids/positions [B, S].

        No cache: causal forward over right-padded rows. With a cache and no kv_lens: prefill
        into `slots`. With kv_lens [B] (S == 1): decode, attending over `kv_width` cached columns.
        """
        # RoPE frequencies in float32 whatever the weights' dtype, as transformers does
        dims = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=ids.device).float()
        inv_freq = 1.0 / (self.rope_theta ** (dims / self.head_dim))
        freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), -1)
        x = self.model.embed_tokens(ids)
        ctx = AttnContext(emb.cos().to(x.dtype), emb.sin().to(x.dtype), cache, slots, kv_lens)
        if kv_lens is not None:
            cols = torch.arange(kv_width, device=ids.device)
            ctx.mask = (cols[None, :] <= kv_lens[:, None])[:, None, None, :]  # [B, 1, 1, W]
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

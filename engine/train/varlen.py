"""Attention over unpadded sequences on PyTorch's own flash-attention kernel
(`torch.nn.attention.varlen`), for CUDA machines without the flash-attn package.

A model loaded with attn_implementation="varlen" runs every sequence of a forward as its own
causal block, found from what transformers hands the attention layer:
- a packed row (no attention mask, sequences end to end): a sequence starts where the
  position ids restart at 0;
- padded rows: the 2-D padding mask (the same one flash-attn's mask function gives), whose
  real tokens are each row's sequence, prompt left- and response right-padded.
Only real tokens go through the kernel, so neither form computes a [T, T] score matrix or a
block-diagonal mask; padding positions come out as zeros.
The trainer finds these boundaries on the host before a forward and hands them to every layer
(`given`, the `varlen_sequences` keyword): a compiled decoder layer then traces as one graph.
Without it (another caller), the layers find them themselves, once per forward, at the cost of
a device sync and a graph break in each layer.

Deterministic mode (engine/exact.py) runs the same sequences through `exact_attention`
(attn_implementation `exact.NAME`): each query against its own keys alone, as the rollout engine
runs it, so a token's output does not depend on its row, its padding or its packing.

Invariants:
- outputs equal SDPA's on the same rows (up to kernel rounding), packed or padded;
- a forward with a KV cache (query and key lengths differ) is refused: this is the trainer's
  and the reference's attention, not generation's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from rlflow.engine import exact
from rlflow.engine.tensors import to_device

NAME = "varlen"
KWARG = "varlen_sequences"  # a forward's keyword that hands every layer `sequences`, found before it (`given`)

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10
    varlen_attn = None  # type: ignore[assignment]
_PARAMS: Mapping[str, Any] = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel exists for CUDA in half precision."""
    return varlen_attn is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


@torch.compiler.disable  # data-dependent sizes: compiled layers call it eagerly, by design
def sequences(position_ids: torch.Tensor | None,
              mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """(flat indices of the real tokens, or None for all of them; cumulative sequence starts [N+1]
    int32; the longest sequence) of rows [B, S]: from the padding mask [B, S] when there is one,
    else from the position ids [B or 1, S], a sequence starting at every row start and wherever
    they restart at 0."""
    if mask is not None:
        keep, lengths = mask.bool().flatten().nonzero().squeeze(1), mask.bool().sum(1, dtype=torch.int32)
    else:
        keep = None
        assert position_ids is not None, "rows without a padding mask need their position ids"
        start = position_ids == 0
        start[:, 0] = True
        ends = torch.tensor([start.numel()], device=start.device)
        lengths = torch.cat([start.flatten().nonzero().squeeze(1), ends]).diff().to(torch.int32)
    return keep, torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)), int(lengths.max())


Found = tuple[torch.Tensor | None, torch.Tensor, int]


def given(model: Any, position_ids: torch.Tensor | None, mask: torch.Tensor | None,
          device: torch.device) -> dict[str, Found]:
    """The keyword for a forward of `model` over rows with these position ids or padding mask
    (`sequences`), on `device`; none unless the model runs this attention. Found before the
    forward, on the host where the rows are: the compiled layers then trace whole, without the
    graph break and the per-forward device sync of finding them inside (`_shared_sequences`)."""
    if getattr(model.config, "_attn_implementation", None) not in (NAME, exact.NAME):
        return {}
    if mask is not None and bool(mask.all()):  # what transformers hands the layers for unpadded rows
        mask = None
    keep, cu, longest = sequences(position_ids, mask)
    return {KWARG: (None if keep is None else to_device(keep, device), to_device(cu, device), longest)}


_last: list[Any] = []  # [source tensor, its version, rows, `sequences` of it]: the last forward's


@torch.compiler.disable
def _shared_sequences(position_ids: torch.Tensor | None, mask: torch.Tensor | None,
                      rows: int) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """`sequences` once per forward, not once per layer (each costs a host sync): every layer gets
    the same mask or position-ids tensor, so the last answer stands while that tensor is the same
    object, unmodified. Holding it keeps its id from going to a new tensor."""
    source = mask if mask is not None else position_ids
    try:
        version = None if source is None else source._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: no reuse
        version = None
    if version is not None and _last and _last[0] is source and _last[1:3] == [version, rows]:
        return _last[3]
    found = sequences(None if position_ids is None else position_ids.expand(rows, -1), mask)
    _last[:] = [] if version is None else [source, version, rows, found]
    return found


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
         scale: float | None) -> torch.Tensor:
    """Causal varlen attention of q [T, heads, D] and k/v [T, kv_heads, D], across torch versions."""
    if "enable_gqa" in _PARAMS:
        extra: dict[str, Any] = {"enable_gqa": True}
    else:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        extra = {}
    if "is_causal" in _PARAMS:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    if "scale" in _PARAMS:
        extra["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        raise NotImplementedError("this torch's varlen attention takes only the default scale")
    return varlen_attn(q, k, v, cu, cu, longest, longest, **extra)  # type: ignore[return-value]  # no aux: a tensor


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, heads, S, D], k/v [B, kv_heads, S, D] -> [B, S, heads, D]."""
    if varlen_attn is None:
        raise RuntimeError("attn_implementation='varlen' needs torch >= 2.10 (torch.nn.attention.varlen)")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("varlen attention has no sliding window")
    if dropout and module.training:
        raise NotImplementedError("varlen attention has no dropout")
    if key.shape[2] != query.shape[2] or (attention_mask is not None and attention_mask.shape[-1] != key.shape[2]):
        raise NotImplementedError("varlen attention runs whole sequences, not decoding against a cache")
    return causal(query, key, value, kwargs["position_ids"], attention_mask, scaling, kwargs.get(KWARG)), None


def causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None,
           mask: torch.Tensor | None, scale: float | None, found: Found | None = None,
           run: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each sequence (`sequences`) of rows q [B, heads, S, D], k/v
    [B, kv_heads, S, D] -> [B, S, heads, D], zeros at padding. `found`: the forward's `sequences`,
    computed before it (`given`); else found here, which breaks a compiled layer's graph. `run`
    attends the real tokens, sequence by sequence (default: the varlen kernel, `_run`)."""
    b, heads, s, d = query.shape
    keep, cu, longest = found or _shared_sequences(position_ids, mask, b)
    q, k, v = (x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value))
    run = run or _run
    if keep is None:
        return run(q, k, v, cu, longest, scale).view(b, s, heads, d)
    out = run(q[keep], k[keep], v[keep], cu, longest, scale)
    return out.new_zeros(b * s, heads, d).index_copy(0, keep, out).view(b, s, heads, d)


def _run_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
               scale: float | None) -> torch.Tensor:
    """`_run`'s contract, a query at a time (`exact.causal`): q [T, heads, D], k/v [T, kv_heads, D]."""
    bounds, scale = cu.tolist(), q.shape[-1] ** -0.5 if scale is None else scale
    return torch.cat([exact.causal(q[a:e], k[a:e].transpose(0, 1), v[a:e].transpose(0, 1), scale)
                      for a, e in zip(bounds[:-1], bounds[1:])])


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Deterministic mode's attention: `attention`'s sequences, each query against its own keys
    alone (engine/exact.py)."""
    if key.shape[2] != query.shape[2] or (dropout and module.training):
        raise NotImplementedError("deterministic attention runs whole sequences, without dropout")
    return causal(query, key, value, kwargs["position_ids"], attention_mask, scaling, kwargs.get(KWARG),
                  _run_exact), None


AttentionInterface.register(NAME, attention)  # models loaded with attn_implementation="varlen" call it
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)  # padded rows: the 2-D mask, or None
AttentionInterface.register(exact.NAME, exact_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(exact.NAME, flash_attention_mask)

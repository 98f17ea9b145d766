"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for the trainer's padded forward.

The ranks of an SP group (`sp` consecutive ranks of the default group) hold the same rows; each
runs the model on a contiguous 1/sp slice of the sequence (the length padded to a multiple of
sp with masked tokens), position ids being the slice's global positions so RoPE is unchanged.
Inside every attention layer an all-to-all turns q/k/v [B, heads, S/sp, D] into
[B, heads/sp, S, D], attention runs over the whole sequence for this rank's heads, and a second
all-to-all brings the output back to [B, S/sp, heads, D]. Both all-to-alls are autograd-aware.

Invariants:
- every response token is predicted on exactly one rank of the group (`owned`): a rank's loss
  and counts cover its own slice, so FSDP's gradient sum over all ranks adds the slices up to
  the gradient of the whole rows;
- each row's real tokens attend causally among themselves: every layer gets the full rows'
  padding mask [B, S] (as a prepared mask mapping, which transformers passes on untouched) and
  the SP group (a layer keyword, kept by activation checkpointing for the recomputation); on
  CUDA in half precision through PyTorch's varlen kernel (engine/train/varlen.py, no [S, S] mask),
  else SDPA with a causal key-padding mask;
- heads are cut in contiguous chunks, so with GQA query head h still reads kv head
  h // (heads / kv_heads): sp must divide the kv heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single
from transformers import AttentionInterface

from rlflow.engine.train import varlen

NAME = "ulysses"  # the attn_implementation of a model whose forwards run sequence-parallel


def sdpa_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] real tokens -> [B, 1, S, S] bool: causal over global positions with padded keys
    hidden. A query also sees itself, so a padding query (nothing else to see) gets a finite
    output instead of NaN; no real token reads it."""
    idx = torch.arange(mask.shape[1], device=mask.device)
    return (((idx[None, :] <= idx[:, None]) & mask[:, None, :]) | (idx[None, :] == idx[:, None]))[:, None]


def check_heads(config: Any, sp: int) -> None:
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % sp or kv % sp:
        raise ValueError(f"sequence parallel size {sp} must divide the attention heads ({heads}) and the "
                         f"key/value heads ({kv})")


def local_span(length: int, group: Any) -> tuple[int, int]:
    """(padded length, this rank's slice start): slices of padded // sp tokens."""
    sp = dist.get_world_size(group)
    padded = -(-length // sp) * sp
    return padded, dist.get_rank(group) * (padded // sp)


def owned(valid: torch.Tensor, length: int, group: Any) -> torch.Tensor:
    """valid [n, R] response mask of rows of `length` tokens -> the tokens this rank predicts:
    response token j is predicted at global position length - R - 1 + j."""
    padded, start = local_span(length, group)
    at = torch.arange(valid.shape[1], device=valid.device) + length - valid.shape[1] - 1
    return valid & (at >= start) & (at < start + padded // dist.get_world_size(group))


def response_hidden(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    valid: torch.Tensor, group: Any) -> torch.Tensor:
    """Final hidden states [M, H] of this rank's slice at the positions that predict its M owned
    response tokens (`valid` [n, R] is already `owned`). ids/mask/positions: [n, L], full rows."""
    n, length = ids.shape
    padded, start = local_span(length, group)
    ids, mask, positions = (F.pad(x, (0, padded - length)) for x in (ids, mask, positions))
    local = slice(start, start + padded // dist.get_world_size(group))
    # a prepared mask mapping goes to every layer as it is, and so does sp_group; activation
    # checkpointing keeps both for the recomputation in backward
    out = model.base_model(input_ids=ids[:, local], position_ids=positions[:, local], use_cache=False,
                           attention_mask={"full_attention": mask.bool()}, sp_group=group)
    predicts = torch.zeros(n, padded, dtype=torch.bool, device=ids.device)
    first = length - valid.shape[1] - 1
    predicts[:, first:first + valid.shape[1]] = valid
    return out.last_hidden_state[predicts[:, local]]  # row-major, as valid[valid] orders the targets


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, h, S/sp, D] (this rank's tokens, all heads) -> [B, h/sp, S, D] (all tokens, its heads)."""
    sp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, sp, h // sp, s, d).transpose(0, 1).contiguous()  # chunk j of the heads goes to rank j
    got = all_to_all_single(torch.empty_like(send), send, group=group)  # [sp, B, h/sp, s, D]: rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, h/sp, S, D] -> [B, S/sp, h, D], the inverse exchange (tokens back to their rank)."""
    sp = dist.get_world_size(group)
    b, h, length, d = x.shape
    send = x.reshape(b, h, sp, length // sp, d).permute(2, 0, 1, 3, 4).contiguous()  # slice j goes to rank j
    got = all_to_all_single(torch.empty_like(send), send, group=group)  # [sp, B, h/sp, s, D]: rank j's heads
    return got.permute(1, 3, 0, 2, 4).reshape(b, length // sp, sp * h, d)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, heads, S/sp, D], k/v [B, kv_heads, S/sp, D] ->
    [B, S/sp, heads, D]."""
    group = kwargs.get("sp_group")
    if group is None or attention_mask is None or attention_mask.dim() != 2:
        raise RuntimeError("a 'ulysses' attention runs only in ulysses.response_hidden (the trainer's forward)")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("sequence parallelism has no sliding-window attention")
    q, k, v = (_seq_to_heads(x, group) for x in (query, key, value))  # [B, h/sp, S, D]
    if varlen.available(q.device, q.dtype):  # only the real tokens, no [S, S] mask
        out = varlen.causal(q, k, v, None, attention_mask, scaling).transpose(1, 2)
    else:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))  # GQA: chunks keep the grouping
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(attention_mask), scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
    return _heads_to_seq(out, group), None


def sum_over(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x (on the CPU) summed over the group, on the CPU: no-grad per-rank parts into whole rows."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"  # nccl reduces device tensors only
    t = x.to(device)
    dist.all_reduce(t, group=group)
    return t.cpu()


AttentionInterface.register(NAME, attention)  # models loaded with attn_implementation="ulysses" call it

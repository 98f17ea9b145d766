"""Shared prompts in a training forward: rows whose prompts are the same packed into one row that
holds the prompt once and every row's response after it, under a mask that lets a response see
only its prompt and itself. The prompt is computed once for all its samples.

Invariants:
- every hidden state, logprob and gradient is what the rows give as separate sequences;
- a prompt token never sees a response, and a response never sees another row's;
- the flex attention block mask never skips a block pair in which some token sees another, and
  marks full only pairs in which every token does.

Run: python -m pytest tests/engine/train/test_train.py -k shared
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

FLEX_BLOCK = 128  # flex attention's default block size (create_block_mask's BLOCK_SIZE)


def shared_prompt_row(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows [n, L] (prompt left-, response right-padded; valid [n, R] the response mask) as one
    packed row that holds each distinct prompt once, each row's response after it: (token ids [T],
    position ids [T], each token's group [T] and row [T] (-1 for a prompt token), and the indices
    [M] of the tokens that predict the valid response tokens, row-major as valid[valid]).

    Under `shared_prompt_mask` a response attends to its prompt and itself, causally, so every
    hidden state equals the one of its own sequence: a prompt token never sees a response."""
    n, length = ids.shape
    cut = length - valid.shape[1]  # where the responses start
    real = mask.bool()
    _, group_of = torch.unique(ids[:, :cut].masked_fill(~real[:, :cut], -1), dim=0, return_inverse=True)
    tokens, pos, group, row, at = [], [], [], [], []
    last: dict[int, int] = {}  # group -> position of its prompt's last token in the packed row

    def append(r: int, cols: slice, keep: torch.Tensor, g: int, owner: int) -> int:
        """Row r's kept tokens in `cols`, as group g's and `owner`'s; how many."""
        count = int(keep.sum())
        tokens.append(ids[r, cols][keep])
        pos.append(positions[r, cols][keep])
        group.append(torch.full((count,), g))
        row.append(torch.full((count,), owner))
        return count

    size = 0
    for r in range(n):
        g = int(group_of[r])
        if g not in last:  # the group's prompt, once
            size += append(r, slice(None, cut), real[r, :cut], g, -1)
            last[g] = size - 1
        start = size
        size += append(r, slice(cut, None), valid[r], g, r)
        if size > start:  # a response's first token follows its prompt's last, each next one its predecessor
            at.append(torch.tensor([last[g], *range(start, size - 1)]))
    return (torch.cat(tokens), torch.cat(pos), torch.cat(group), torch.cat(row),
            torch.cat(at) if at else torch.zeros(0, dtype=torch.long))


def pad_to_blocks(tokens: torch.Tensor, pos: torch.Tensor, group: torch.Tensor, row: torch.Tensor,
                  block: int = FLEX_BLOCK) -> tuple[torch.Tensor, ...]:
    """`shared_prompt_row`'s row padded to a whole number of flex attention's blocks. The padding
    is a group of its own (-1): it sees only itself, and no real token sees it. Unpadded, the last
    block's mask would be evaluated past the row's end, beyond `group` and `row`."""
    extra = -len(tokens) % block
    if not extra:
        return tokens, pos, group, row
    return (torch.cat([tokens, tokens.new_zeros(extra)]), torch.cat([pos, pos.new_zeros(extra)]),
            torch.cat([group, group.new_full((extra,), -1)]), torch.cat([row, row.new_full((extra,), -1)]))


def shared_prompt_mask(group: torch.Tensor, row: torch.Tensor, flex: bool) -> BlockMask | torch.Tensor:
    """The attention mask of `shared_prompt_row`: a token sees the earlier tokens of its group's
    prompt and of its own row. For flex attention a block mask, which skips the blocks nobody sees;
    else (SDPA: the CPU, where flex attention has no backward) a dense [1, 1, T, T] bool mask."""
    def allowed(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k <= q) & (group[q] == group[k]) & ((row[k] < 0) | (row[q] == row[k]))

    if flex:
        return shared_block_mask(group, row, lambda b, h, q, k: allowed(q, k))
    at = torch.arange(len(group), device=group.device)
    return allowed(at[:, None], at[None, :])[None, None]


def shared_block_mask(group: torch.Tensor, row: torch.Tensor, mask_mod: Callable[..., torch.Tensor]) -> BlockMask:
    """The block mask of a shared row padded to whole blocks (`pad_to_blocks`), judged per pair of
    blocks from the span of groups and rows each holds, instead of at every token pair as
    create_block_mask does: compiled, that costs a build of Triton kernels for every new row
    length (over 40 s each on an H200, the stall of shared prompts on mixed lengths); eager, a
    [T, T] mask. Key block j <= query block i is skipped when no token of one can see a token of
    the other: their group spans do not meet, or the key block holds only responses whose rows
    the query block's do not meet. It is full when every token pair sees: j < i, one group,
    and the key block all prompt, or both blocks one same row. Otherwise `mask_mod` decides each
    pair. Spans over-cover a group or row split across the row, which costs compute, never a
    wrong token."""
    n = len(group) // FLEX_BLOCK
    g, r = group.view(n, FLEX_BLOCK), row.view(n, FLEX_BLOCK)
    response = r >= 0
    lo, hi = g.amin(1), g.amax(1)
    rlo = torch.where(response, r, torch.iinfo(r.dtype).max).amin(1)
    rhi = torch.where(response, r, -1).amax(1)
    has_prompt, all_prompt = (~response).any(1), ~response.any(1)
    one_row = ~has_prompt & (rlo == rhi)
    q, k = torch.arange(n, device=group.device)[:, None], torch.arange(n, device=group.device)[None, :]
    meet = lambda a, b: (a[:, None] <= b[None, :]) & (a[None, :] <= b[:, None])  # noqa: E731  # spans overlap
    seen = (k <= q) & meet(lo, hi) & (has_prompt[None, :] | meet(rlo, rhi))
    same_group = (lo == hi)[:, None] & (lo == hi)[None, :] & (lo[:, None] == lo[None, :])
    same_row = one_row[:, None] & one_row[None, :] & (rlo[:, None] == rlo[None, :])
    full = (k < q) & same_group & (all_prompt[None, :] | same_row)

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts [1, 1, n], indices [1, 1, n, n]
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True)
        return blocks.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(seen & ~full), *listed(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(len(group), len(group)))

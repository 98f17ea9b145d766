"""How a step's rows split into micro-batches and over data-parallel ranks: plans of row indices,
made on the host before any forward.

Invariants:
- a micro-batch never exceeds its token budget (real tokens when packing, rows x width when
  padded) unless one sequence, or one shared prompt with one response, alone does;
- packed, a step's micro-batches are as few as first-fit decreasing makes and, where they fit,
  evened out (`even_bins`);
- every row lands in exactly one micro-batch (one part, for `balance`);
- with shared prompts, a group's rows stay together unless they overflow the budget, and each
  part of a split group counts its prompt again.

Run: python -m pytest tests/engine/train/test_train.py -k "micro_batches or balance"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def micro_batches(mask: torch.Tensor, budget: int, pack: bool, group_size: int = 1,
                  prompt_width: int = 0) -> list[torch.Tensor]:
    """Row indices of each micro-batch of `mask` [N, L]: packed, sequences grouped by real length
    (`even_bins`); padded, consecutive rows of rows x L <= budget (>= 1 row).

    With `prompt_width` (shared prompts, `shared_prompt_row`), each run of `group_size` rows shares
    the prompt in its first `prompt_width` columns: groups are packed whole, counting their prompt
    once; a group over the budget is split, each part counting the prompt again."""
    if not prompt_width:
        if pack:
            return [torch.tensor(rows) for rows in even_bins(mask.sum(1).tolist(), budget)]
        per = max(1, budget // mask.shape[1])
        return [torch.arange(i, min(i + per, len(mask))) for i in range(0, len(mask), per)]
    real, prompt = mask.sum(1).tolist(), mask[:, :prompt_width].sum(1).tolist()
    parts: list[list[int]] = []  # rows that share one copy of their prompt
    sizes: list[int] = []  # their tokens
    for first in range(0, len(mask), group_size):
        for r in range(first, min(first + group_size, len(mask))):
            extra = real[r] - prompt[r]  # the row's response, after its group's prompt
            if r == first or sizes[-1] + extra > budget:
                parts.append([])
                sizes.append(prompt[r])
            parts[-1].append(r)
            sizes[-1] += extra
    return [torch.tensor([r for i in sorted(bin_) for r in parts[i]]) for bin_ in even_bins(sizes, budget)]


def first_fit_decreasing(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` in bins of total <= budget; an item larger than the budget gets its own bin."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fit = next((b for b, load in enumerate(loads) if load + sizes[i] <= budget), None)
        if fit is None:
            bins.append([])
            loads.append(0)
            fit = len(bins) - 1
        bins[fit].append(i)
        loads[fit] += sizes[i]
    return bins


def even_bins(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` in as many bins as first-fit decreasing needs, with their totals evened out
    (largest first, each onto the lightest bin): no bin is lighter than another by more than the
    largest item. First-fit's bins instead where evening would overflow a bin with more than one item.
    A small last micro-batch runs below the device's rate, and a compiled layer traces again for
    it (its cached kernels carry a size guard)."""
    bins = first_fit_decreasing(sizes, budget)
    even = balance(sizes, len(bins), room=len(sizes))
    fits = all(sum(sizes[i] for i in b) <= budget or len(b) == 1 for b in even)
    return even if fits else bins


def balance(loads: Sequence[float], parts: int, room: int = 0) -> list[list[int]]:
    """Indices of `loads` in `parts` parts of at most `room` items each (default: equal counts, len
    divisible by parts) with near-equal sums: heaviest first, each onto the lightest part that still
    has room (greedy largest-first)."""
    size = room or len(loads) // parts
    out: list[list[int]] = [[] for _ in range(parts)]
    sums = [0.0] * parts
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        part = min((p for p in range(parts) if len(out[p]) < size), key=lambda p: sums[p])
        out[part].append(i)
        sums[part] += loads[i]
    return out

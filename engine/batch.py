"""The one record that flows between stages during a step.

N = sequences in the batch (prompts x samples_per_prompt), P = padded prompt length,
R = padded response length. Prompts are LEFT-padded and responses RIGHT-padded, so
`cat([prompt_ids, response_ids], 1)` puts every response right after its prompt, and logits at
column P-1+t predict response token t for every row alike.

Invariants:
- rows of one prompt are contiguous (`group_size` of them), which the group advantages rely on;
- fields start empty (0-element tensors, empty lists) and each stage fills its own:
  rollout -> response_*, rollout_logprobs (and baseline_responses for ReMax); reward -> scores
  (and baseline_scores); reference -> ref_logprobs; critic -> values;
  actor -> old_logprobs, then advantages (and, for GAE, the critic's returns);
- `timing` and `metrics` accumulate per-phase numbers on the way to the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _empty() -> torch.Tensor:
    return torch.empty(0)


@dataclass
class Batch:
    prompt_ids: torch.Tensor  # [N, P] int64, left-padded
    prompt_mask: torch.Tensor  # [N, P] int64
    group_size: int
    data_source: list[str]
    ground_truth: list[str]
    extra_info: list[dict | None]
    response_ids: torch.Tensor = field(default_factory=_empty)  # [N, R] int64, right-padded
    response_mask: torch.Tensor = field(default_factory=_empty)  # [N, R] float32, 1 on generated tokens (incl. eos)
    rollout_logprobs: torch.Tensor = field(default_factory=_empty)  # [N, R] float32, from the rollout engine
    finish_reason: list[str] = field(default_factory=list)  # "stop" | "length"
    prompt_text: list[str] = field(default_factory=list)  # templated prompt, for sample tables
    responses: list[str] = field(default_factory=list)  # decoded, special tokens skipped
    scores: torch.Tensor = field(default_factory=_empty)  # [N] float32
    ref_logprobs: torch.Tensor = field(default_factory=_empty)  # [N, R]
    old_logprobs: torch.Tensor = field(default_factory=_empty)  # [N, R]
    advantages: torch.Tensor = field(default_factory=_empty)  # [N, R]
    values: torch.Tensor = field(default_factory=_empty)  # [N, R] float32, critic: V of the state before token t
    returns: torch.Tensor = field(default_factory=_empty)  # [N, R] GAE's advantage + value: the critic's target
    baseline_responses: list[str] = field(default_factory=list)  # ReMax: the prompt's greedy response, per row
    baseline_scores: torch.Tensor = field(default_factory=_empty)  # [N] ReMax: the reward of that response
    step: int = 0  # the RL step whose rollout made these rows (RolloutRequest.step)
    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [N, P+R], attention_mask [N, P+R], position_ids [N, P+R]) for a forward."""
        ids = torch.cat([self.prompt_ids, self.response_ids], 1)
        mask = torch.cat([self.prompt_mask, self.response_mask.long()], 1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        return ids, mask, positions

    def rows(self, index: torch.Tensor | slice) -> Batch:
        """A sub-batch of whole rows (tensors indexed on dim 0, lists picked alike)."""
        idx = torch.arange(len(self))[index]
        picked: dict = {}
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor) and value.numel():
                picked[name] = value[idx]
            elif isinstance(value, list) and len(value) == len(self):
                picked[name] = [value[i] for i in idx.tolist()]
            else:
                picked[name] = value
        return Batch(**picked)

    @staticmethod
    def cat(batches: list[Batch]) -> Batch:
        """The rows of several batches in order, re-padded to the widest; timing and metrics stay empty,
        group size and step are the first batch's.

        Prompts are left-padded and responses right-padded again, with 0 under a 0 mask.
        """
        first = batches[0]
        joined: dict = {"group_size": first.group_size, "step": first.step, "timing": {}, "metrics": {}}
        for name, value in vars(first).items():
            if isinstance(value, torch.Tensor) and value.numel():
                joined[name] = _cat_padded([getattr(b, name) for b in batches], left=name.startswith("prompt"))
            elif isinstance(value, list) and len(value) == len(first):
                joined[name] = [x for b in batches for x in getattr(b, name)]
        return Batch(**joined)


def _cat_padded(parts: list[torch.Tensor], left: bool) -> torch.Tensor:
    """Concatenate on dim 0, zero-padding dim 1 (if any) on the left or right to the widest part."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    pad = lambda p: (width - p.shape[1], 0) if left else (0, width - p.shape[1])  # noqa: E731
    return torch.cat([torch.nn.functional.pad(p, pad(p)) for p in parts])


@dataclass
class RolloutRequest:
    """What the driver sends a rollout worker: its shard of prompts and how to sample them."""
    prompts: list  # list[engine.data.Prompt]
    step: int  # seeds sampling, so a resumed or replayed step draws the same samples
    greedy: bool = False  # validation decodes greedily, one sample per prompt
    samples: int = 0  # samples per prompt; 0 = rollout.samples_per_prompt, i.e. a training rollout

"""Batch.cat: rows of several batches in order, prompts re-left-padded, responses re-right-padded."""

from __future__ import annotations

import torch

from rlflow.engine.batch import Batch


def _batch(prompts: list[list[int]], responses: list[list[int]], scores: list[float]) -> Batch:
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    return Batch(
        prompt_ids=torch.tensor([[0] * (width_p - len(p)) + p for p in prompts]),
        prompt_mask=torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        group_size=1, data_source=["a"] * len(prompts), ground_truth=["1"] * len(prompts),
        extra_info=[None] * len(prompts),
        response_ids=torch.tensor([r + [0] * (width_r - len(r)) for r in responses]),
        response_mask=torch.tensor([[1.0] * len(r) + [0.0] * (width_r - len(r)) for r in responses]),
        responses=[str(r) for r in responses], scores=torch.tensor(scores), timing={"gen": 1.0},
    )


def test_cat_repads_and_keeps_row_order() -> None:
    one = _batch([[5, 6]], [[7]], [1.0])
    two = _batch([[8, 9, 4], [3]], [[1, 2, 3], [2]], [0.0, 0.5])
    both = Batch.cat([one, two])
    assert both.prompt_ids.tolist() == [[0, 5, 6], [8, 9, 4], [0, 0, 3]]  # left-padded to 3
    assert both.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert both.response_ids.tolist() == [[7, 0, 0], [1, 2, 3], [2, 0, 0]]  # right-padded to 3
    assert both.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert both.scores.tolist() == [1.0, 0.0, 0.5]
    assert both.responses == ["[7]", "[1, 2, 3]", "[2]"]
    assert both.ref_logprobs.numel() == 0 and both.timing == {}  # empty stays empty; timing is the caller's
    # every response still sits right after its prompt, so positions and logits line up as before
    _, mask, pos = both.sequences()
    assert pos[0].tolist() == [0, 0, 1, 2, 2, 2] and mask[0].tolist() == [0, 1, 1, 1, 0, 0]


def test_rows_and_cat_carry_values_returns_and_step() -> None:
    one, two = _batch([[5]], [[7]], [1.0]), _batch([[8], [3]], [[1, 2], [2]], [0.0, 0.5])
    for b, step in ((one, 4), (two, 4)):
        b.values, b.returns, b.step = b.response_mask * 0.5, b.response_mask * 2.0, step
    both = Batch.cat([one, two])
    assert both.step == 4
    assert both.values.tolist() == [[0.5, 0.0], [0.5, 0.5], [0.5, 0.0]]  # right-padded with 0, like responses
    assert both.returns.tolist() == [[2.0, 0.0], [2.0, 2.0], [2.0, 0.0]]
    last = both.rows(torch.tensor([2]))
    assert last.values.tolist() == [[0.5, 0.0]] and last.returns.tolist() == [[2.0, 0.0]] and last.step == 4

"""Unpadded attention on PyTorch's varlen kernel: where sequences start (CPU), and the trainer's
forward through it against SDPA, packed and padded, values and gradients (CUDA)."""

import pytest
import torch
from test_train import padded_batch
from transformers import AutoModelForCausalLM

from rlflow.engine.train import varlen
from rlflow.engine.train.fsdp import forward_logprobs

CPU = torch.device("cpu")


def test_sequences_restart_at_position_zero_and_at_every_row():
    keep, cu, longest = varlen.sequences(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), None)
    assert keep is None and cu.tolist() == [0, 3, 5, 9] and longest == 4 and cu.dtype == torch.int32
    _, cu, longest = varlen.sequences(torch.arange(4).expand(2, 4), None)  # two unpadded rows
    assert cu.tolist() == [0, 4, 8] and longest == 4
    _, cu, _ = varlen.sequences(torch.tensor([[5, 6, 7], [8, 9, 10]]), None)  # rows start sequences, not only 0s
    assert cu.tolist() == [0, 3, 6]


def test_sequences_of_padded_rows_are_their_real_tokens():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    keep, cu, longest = varlen.sequences(torch.zeros(3, 5, dtype=torch.long), mask)
    assert keep.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 12] and cu.tolist() == [0, 3, 8, 9] and longest == 5


def test_a_forwards_layers_share_one_scan_of_its_sequences():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    first = varlen._shared_sequences(pos, None, 2)  # what every layer of a forward asks, with the same tensor
    assert varlen._shared_sequences(pos, None, 2) is first and first[1].tolist() == [0, 3, 5, 8, 10]
    again = varlen._shared_sequences(pos.clone(), None, 2)  # the next forward's tensor: scanned anew
    assert again is not first and again[1].tolist() == first[1].tolist()
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    varlen._shared_sequences(pos, None, 1)
    pos[0, 3] = 3  # changed in place: its version moves on, so the scan runs again
    assert varlen._shared_sequences(pos, None, 1)[1].tolist() == [0, 5]
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    padded = varlen._shared_sequences(None, mask, 2)
    assert varlen._shared_sequences(None, mask, 2) is padded and padded[0].tolist() == [1, 2, 3, 4, 5]
    with torch.inference_mode():  # no version counter to trust: scanned every time
        frozen = torch.tensor([[0, 1, 0]])
        assert varlen._shared_sequences(frozen, None, 1) is not varlen._shared_sequences(frozen, None, 1)


def test_the_trainer_finds_a_forwards_sequences_before_it_for_varlen_models_only(model_dir):
    varlen_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="varlen")
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    [(keep, cu, longest)] = varlen.given(varlen_model, pos, None, CPU).values()
    assert keep is None and cu.tolist() == [0, 3, 5] and longest == 3
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    [(keep, cu, longest)] = varlen.given(varlen_model, torch.zeros(2, 3, dtype=torch.long), mask, CPU).values()
    assert keep.tolist() == [1, 2, 3, 4, 5] and cu.tolist() == [0, 2, 5] and longest == 3
    # no padding: transformers hands the layers no mask, so the rows are read off the position ids
    [(keep, cu, _)] = varlen.given(varlen_model, torch.arange(3).expand(2, 3), torch.ones(2, 3), CPU).values()
    assert keep is None and cu.tolist() == [0, 3, 6]
    sdpa = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    assert varlen.given(sdpa, pos, None, CPU) == {}


def test_varlen_is_chosen_only_where_its_kernel_runs():
    assert not varlen.available(torch.device("cpu"), torch.bfloat16)
    assert not varlen.available(torch.device("cuda"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_forward_matches_sdpa_packed_and_padded(model_dir, dtype):
    """The trainer's logprobs, entropies and gradients with varlen attention, packed and padded,
    against SDPA on padded rows; the gap is kernel rounding in half precision."""
    ids, mask, pos, responses = padded_batch([3, 7, 1, 5, 12], [6, 2, 9, 4, 11])
    runs = {}
    for name, attn, pack in [("sdpa", "sdpa", False), ("padded", "varlen", False), ("packed", "varlen", True)]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).cuda()
        logp, ent = forward_logprobs(model, ids, mask, pos, responses, 0.7, pack)
        ((logp.sum() + 0.1 * ent.sum()) / mask.sum()).backward()
        runs[name] = logp, ent, torch.cat([p.grad.float().flatten() for p in model.parameters()])
    valid = responses.cuda() != 0
    for name in ("padded", "packed"):
        for got, want in zip(runs[name], runs["sdpa"]):
            scale = want.abs().max()
            assert (got - want).abs().max() < 2e-2 * scale, name
        assert torch.equal(runs[name][0] != 0, valid)  # every real response token, no padding


@pytest.mark.gpu
def test_compiled_layers_trace_whole_with_the_sequences_found_before_the_forward(model_dir):
    """The trainer hands each forward's sequences to every layer: compiled decoder layers run
    without a graph break, packed and padded, to the eager model's numbers."""
    from torch._dynamo.utils import counters
    ids, mask, pos, responses = padded_batch([3, 7, 1, 5, 12], [6, 2, 9, 4, 11])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="varlen").cuda()
    for pack in (True, False):
        want, _ = forward_logprobs(model, ids, mask, pos, responses, 0.7, pack)
        for layer in model.model.layers:
            layer.compile()
        torch._dynamo.reset()
        counters.clear()
        got, _ = forward_logprobs(model, ids, mask, pos, responses, 0.7, pack)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert (got - want).abs().max() < 2e-2 * want.abs().max()
        for layer in model.model.layers:
            layer._compiled_call_impl = None  # back to eager for the next form's reference

"""Deterministic mode: the native engine's logprobs and the trainer's are equal bit for bit, for the
same token batched however each side batches it (engine/exact.py), and differ without the mode."""

import pytest
import torch
from transformers import AutoTokenizer

from rlflow.engine import exact
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.model import NativeCausalLM
from rlflow.engine.rollout.native import NativeRollout
from rlflow.engine.tensors import left_pad
from rlflow.engine.train.fsdp import TrainEngine, forward_logprobs

PROMPTS = ["1+1=", "12+7=", "3+4=", "99+99=", "5+", "123+456=579, 22+33=55, 40+2="]


@pytest.fixture(autouse=True)
def one_thread():
    """The mode's reductions are per row on one thread (engine/exact.py); workers run one by default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_row_of_a_product_is_the_same_in_any_batch_and_any_split_of_the_outputs():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(40, 96, generator=g), torch.randn(48, 96, generator=g), torch.randn(48, generator=g)
    whole = exact.linear(x, w, b)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 22), slice(17, 40)):
        assert torch.equal(exact.linear(x[rows], w, b), whole[rows])
    assert torch.equal(exact.linear(x, w[:16], b[:16]), whole[:, :16])  # a fused projection split into its parts
    torch.testing.assert_close(whole, torch.nn.functional.linear(x, w, b))


def test_its_gradients_are_a_plain_products_and_hold_no_batch_of_weights():
    """Training in the mode: the backward is F.linear's, without the [rows, K, N] gradient that
    autograd through a weight expanded over the rows would build (151k-token vocabularies)."""
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((3, 5, 16), (12, 16), (12,)))
    grad = torch.randn(3, 5, 12, generator=g)
    exact.linear(x, w, b).backward(grad)
    want = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*want).backward(grad)
    for got, ref in zip((x, w, b), want):
        torch.testing.assert_close(got.grad, ref.grad)


def rollout_and_trainer(model_dir, deterministic: bool) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(rollout logprobs, trainer logprobs) [N, R] of one engine's answers, each way the trainer
    batches them, for a first turn and for a second that continues it."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = NativeCausalLM.from_pretrained(model_dir, torch.float32, "cpu")
    if deterministic:
        model.exact()
    # 18 sequences in 5 slots: slots reused and moved; a 12-token prefill budget: the long prompt in chunks
    engine = NativeRollout(model, tok, max_slots=5, max_len=128, max_prefill_tokens=12)
    trainer = TrainEngine(str(model_dir), 1e-6, 0.0, 1.0, 0, 10, "constant", "float32", "cpu",
                          deterministic=deterministic)
    prompts = [tok.encode(t) for t in PROMPTS]
    first = [c for g in engine.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=3))
             for c in g]
    assert engine.between > 0, "the long prompt went in chunks, with decode steps between them"
    out = compare(trainer, [p for p in prompts for _ in range(3)], first, tok.pad_token_id, "first turn")
    # turn 2: each sample's history, an observation, and a new answer; the engine continues the
    # histories its slots still hold (their new tokens fed through decode steps or prefilled after them)
    turn2 = [p + c.token_ids + tok.encode(f" -> {i * 37} ok.") for i, (p, c) in
             enumerate(zip([p for p in prompts for _ in range(3)], first))]
    reused = engine.scheduler.reused
    second = [g[0] for g in engine.generate(turn2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=4))]
    assert engine.scheduler.reused > reused, "some second turns continued a cached history"
    return out + compare(trainer, turn2, second, tok.pad_token_id, "continued turn")


def compare(trainer: TrainEngine, prompts: list[list[int]], answers: list, pad: int,
            what: str) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    pids, pmask = left_pad(prompts, pad)
    width = max(len(c.token_ids) for c in answers)
    rids = torch.tensor([c.token_ids + [pad] * (width - len(c.token_ids)) for c in answers])
    rmask = torch.tensor([[1] * len(c.token_ids) + [0] * (width - len(c.token_ids)) for c in answers])
    mask, ids = torch.cat([pmask, rmask], 1), torch.cat([pids, rids], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    rollout = torch.zeros(rids.shape)
    for i, c in enumerate(answers):
        rollout[i, :len(c.token_ids)] = torch.tensor(c.logprobs)
    n, out = len(answers), []
    with torch.no_grad():
        for pack in (False, True):
            for groups in ([list(range(n))], [list(range(7)), list(range(7, n))], [[i] for i in range(n)]):
                got = torch.zeros(rids.shape)
                for rows in groups:  # padded to each group's widest row, or packed end to end
                    got[rows] = forward_logprobs(trainer.root, ids[rows], mask[rows], positions[rows], rids[rows],
                                                 1.0, pack)[0]
                out.append((rollout, got * rmask, f"{what}, {'packed' if pack else 'padded'}, {len(groups)} groups"))
    return out


def test_rollout_logprobs_equal_the_trainers_bit_for_bit_in_deterministic_mode(model_dir):
    for rollout, trainer, how in rollout_and_trainer(model_dir, deterministic=True):
        assert torch.equal(rollout, trainer), f"{how}: {int((rollout != trainer).sum())} tokens differ"


def test_without_the_mode_they_differ_in_the_last_bits(model_dir):
    """What the mode removes: the same token batched another way rounds another way."""
    pairs = rollout_and_trainer(model_dir, deterministic=False)
    assert all(not torch.equal(rollout, trainer) for rollout, trainer, _ in pairs)
    assert max(float((r - t).abs().max()) for r, t, _ in pairs) < 1e-4  # the same model, up to rounding

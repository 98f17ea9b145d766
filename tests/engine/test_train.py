import pytest
import torch

from engine.train import TrainEngine, lr_lambda, micro_batches


def test_micro_batches_respect_budget_and_cover_rows():
    chunks = micro_batches(10, 12, 40)
    assert [c.stop - c.start for c in chunks] == [3, 3, 3, 1]
    assert micro_batches(2, 50, 10) == [slice(0, 1), slice(1, 2)]  # a row wider than the budget still runs


def test_lr_schedule():
    f = lr_lambda(2, 12, "cosine")
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(7) == pytest.approx(0.5) and f(12) == pytest.approx(0.0)
    assert lr_lambda(0, 10, "constant")(9) == 1.0


def sft_losses(engine, ids, per_micro):
    """Summed-token cross-entropy over a fixed denominator, split into micro-batches of `per_micro` rows."""
    denom = float(ids[:, 1:].numel())

    def loss(rows):
        logits = engine.model(input_ids=ids[rows]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[rows][:, 1:, None]).squeeze(-1)
        return -logp.sum() / denom

    return lambda: [lambda r=slice(i, i + per_micro): loss(r) for i in range(0, len(ids), per_micro)]


def test_one_micro_batch_of_8_equals_8_of_1(model_dir):
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (8, 6))
    a = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    b = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    out_a = a.step(sft_losses(a, ids, 8))
    out_b = b.step(sft_losses(b, ids, 1))
    assert out_a["loss"] == pytest.approx(out_b["loss"], rel=1e-5)
    assert out_a["grad_norm"] == pytest.approx(out_b["grad_norm"], rel=1e-4)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_non_finite_loss_skips_the_step(model_dir):
    engine = TrainEngine(str(model_dir), 1e-2, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    before = [p.detach().clone() for p in engine.model.parameters()]
    nan = lambda: [lambda: engine.model.model.embed_tokens.weight.sum() * float("nan")]  # noqa: E731
    out = engine.step(nan)
    assert out["skipped_steps"] == 1 and out["consecutive_skips"] == 1
    assert all(torch.equal(p, q) for p, q in zip(before, engine.model.parameters()))

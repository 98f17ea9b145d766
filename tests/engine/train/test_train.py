import random
import shutil

import pytest
import torch
from conftest import leave_group
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rlflow.engine import algos
from rlflow.engine.train.batching import balance, even_bins, first_fit_decreasing, micro_batches
from rlflow.engine.train.fsdp import TrainEngine, chunked_token_stats, forward_logprobs, lr_lambda, step_metrics
from rlflow.engine.train.shared_prompts import pad_to_blocks, shared_prompt_mask, shared_prompt_row


def test_padded_micro_batches_respect_budget_and_cover_rows():
    chunks = micro_batches(torch.ones(10, 12), 40, pack=False)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(micro_batches(torch.ones(2, 50), 10, pack=False)) == 2  # a row wider than the budget still runs


def test_packed_micro_batches_hold_real_tokens_within_budget():
    mask = torch.zeros(6, 10)
    for row, n in enumerate([9, 2, 5, 4, 1, 6]):
        mask[row, 10 - n:] = 1  # left padding, as prompts have it
    chunks = micro_batches(mask, 10, pack=True)
    assert sorted(r for c in chunks for r in c.tolist()) == list(range(6))
    assert [int(mask[c].sum()) for c in chunks] == [9, 9, 9]  # 27 tokens in the fewest bins of 10, evened out
    assert first_fit_decreasing([12, 3], 10) == [[0], [1]]  # too long for the budget: alone
    assert even_bins([12, 3], 10) == [[0], [1]]


def test_packed_micro_batches_are_even_and_as_few_as_first_fit_makes():
    """No small last micro-batch: each costs a compiled layer another trace on CUDA, and runs below
    the device's rate. Sequence lengths as a GRPO step's, 16k-token micro-batches."""
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(40, 1200) for _ in range(rng.randint(50, 600))]
        bins = even_bins(sizes, 16384)
        loads = [sum(sizes[i] for i in b) for b in bins]
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert len(bins) == len(first_fit_decreasing(sizes, 16384)) and max(loads) <= 16384
        assert max(loads) - min(loads) <= max(sizes), loads


def test_balance_splits_equal_counts_with_near_equal_loads():
    loads = [900, 60, 500, 480, 70, 950, 55, 65]
    parts = balance(loads, 2)
    assert sorted(i for p in parts for i in p) == list(range(8)) and [len(p) for p in parts] == [4, 4]
    sums = sorted(sum(loads[i] for i in p) for p in parts)
    assert sums == [1530, 1550]  # contiguous halves would be 1940 / 1140


def padded_batch(prompt_lens, response_lens, vocab=90):
    """Left-padded prompts and right-padded responses of the given lengths: (ids, mask, pos, responses)."""
    torch.manual_seed(1)
    P, R = max(prompt_lens), max(response_lens)
    ids = torch.randint(3, vocab, (len(prompt_lens), P + R))
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, P - p:P + r] = 1
    ids = ids * mask  # pad id 0 under the mask, as the batch has it
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0), ids[:, P:]


def test_packed_forward_matches_padded_values_and_gradients(model_dir):
    engine = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    ids, mask, pos, responses = padded_batch([3, 7, 1, 5], [6, 2, 9, 4])
    grads, values = [], []
    for pack in (True, False):
        engine.model.zero_grad()
        logp, ent = forward_logprobs(engine.root, ids, mask, pos, responses, 0.7, pack, chunk=5)
        loss = (logp.sum() + 0.1 * ent.sum()) / mask.sum()
        loss.backward()
        values.append((logp, ent))
        grads.append([p.grad.clone() for p in engine.model.parameters()])
    valid = mask[:, -responses.shape[1]:].bool()
    assert torch.all(values[0][0][~valid] == 0) and torch.all(values[0][0][valid] < 0)
    torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(engine.model.named_parameters(), *grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
    # a padded row leaks into its neighbours if the packed attention ignored sequence boundaries
    alone, _ = forward_logprobs(engine.root, ids[1:2], mask[1:2], pos[1:2], responses[1:2], 0.7, True)
    torch.testing.assert_close(alone[0], values[0][0][1].detach(), rtol=1e-5, atol=1e-6)


def grouped_batch(prompt_lens, samples, response_lens):
    """`padded_batch` whose rows come in runs of `samples` with one prompt each (as a rollout's
    groups): prompt_lens per group, response_lens per row."""
    ids, mask, pos, responses = padded_batch([p for p in prompt_lens for _ in range(samples)], response_lens)
    width = ids.shape[1] - responses.shape[1]
    for first in range(0, len(ids), samples):
        ids[first:first + samples, :width] = ids[first, :width]
    return ids, mask, pos, responses


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("prompts,responses", [
    ([4, 7, 4], [5, 2, 9, 4, 1, 6, 3, 8, 2]),  # within one 128-token block; the last prompt is the first's
    ([140, 70, 233], [130, 25, 341, 17, 250, 2, 95, 128, 19]),  # 1,418 tokens: eleven blocks and a partial one
], ids=["one-block", "mixed-lengths"])
def test_shared_prompts_match_separate_sequences_values_and_gradients(model_dir, device, prompts, responses):
    """The CPU runs the shared row under SDPA with a dense mask, CUDA under flex attention's block
    mask (the layers in float32 on both, for a tight comparison)."""
    # three groups of 3 samples; in the first case the last group's prompt is the first's (a prompt drawn twice)
    ids, mask, pos, responses = grouped_batch(prompts, 3, responses)
    if prompts[0] == prompts[-1]:
        ids[6:, :ids.shape[1] - responses.shape[1]] = ids[0, :ids.shape[1] - responses.shape[1]]
    engine = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", device, share_prompts=True)
    grads, values = [], []
    for share in (True, False):
        engine.model.zero_grad()
        logp, ent = forward_logprobs(engine.root, ids, mask, pos, responses, 0.7, False, chunk=5, share=share)
        ((logp.sum() + 0.1 * ent.sum()) / mask.sum()).backward()
        values.append((logp, ent))
        grads.append([p.grad.clone() for p in engine.model.parameters()])
    torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=1e-6)
    for (name, _), a, b in zip(engine.model.named_parameters(), *grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
    # a response attending to another sample's tokens would change its logprobs
    alone, _ = forward_logprobs(engine.root, ids[4:5], mask[4:5], pos[4:5], responses[4:5], 0.7, False)
    torch.testing.assert_close(alone[0], values[0][0][4].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="flex attention compiles (inductor)")
@pytest.mark.parametrize("prompts,responses", [
    ([4, 7], [5, 2, 9, 4, 1, 6]),  # one partial 128-token block
    ([40, 70, 33], [30, 25, 41, 17, 50, 22, 35, 28, 19]),  # 410 tokens: three full blocks and a partial one
], ids=["one-block", "four-blocks"])
def test_shared_prompt_block_mask_gives_the_dense_masks_values(model_dir, prompts, responses):
    """CUDA's shared-prompt attention (flex, a block mask) computes what the CPU's dense mask does;
    flex attention has no backward on the CPU, so only the forward is compared here."""
    ids, mask, pos, responses = grouped_batch(prompts, 3, responses)
    out = []
    for attention in ("flex_attention", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
        with torch.no_grad():
            out.append(forward_logprobs(model, ids, mask, pos, responses, 0.7, False, share=True))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_a_shared_row_under_flex_attention_fills_whole_blocks_that_no_token_sees():
    ids, mask, pos, responses = grouped_batch([40, 70, 33], 3, [30, 25, 41, 17, 50, 22, 35, 28, 19])
    tokens, positions, group, row, _ = shared_prompt_row(ids, mask, pos, mask[:, -responses.shape[1]:].bool())
    padded = pad_to_blocks(tokens, positions, group, row)
    assert len(tokens) == 410 and all(len(x) == 512 for x in padded)
    assert all(torch.equal(a[:410], b) for a, b in zip(padded, (tokens, positions, group, row)))
    seen = shared_prompt_mask(padded[2], padded[3], flex=False)[0, 0]
    assert not seen[:410, 410:].any() and not seen[410:, :410].any()  # the padding and the row never meet
    assert seen.any(1).all()  # every query sees something (itself, at least): no empty softmax


def test_the_shared_block_mask_lists_every_block_pair_that_sees_and_no_partly_seen_one_as_full():
    ids, mask, pos, responses = grouped_batch([40, 300, 33], 3, [30, 25, 41, 170, 250, 22, 135, 28, 19])
    tokens, positions, group, row, _ = shared_prompt_row(ids, mask, pos, mask[:, -responses.shape[1]:].bool())
    group, row = pad_to_blocks(tokens, positions, group, row)[2:]
    n = len(group) // 128
    seen = shared_prompt_mask(group, row, flex=False)[0, 0].view(n, 128, n, 128).transpose(1, 2)  # [n, n, 128, 128]
    blocks = shared_prompt_mask(group, row, flex=True)

    def dense(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            out[i, indices[0, 0, i, :counts[0, 0, i]].long()] = True
        return out
    partial = dense(blocks.kv_num_blocks, blocks.kv_indices)
    full = dense(blocks.full_kv_num_blocks, blocks.full_kv_indices)
    assert not (partial & full).any()
    assert torch.equal((partial | full) | ~seen.any((2, 3)), torch.ones(n, n, dtype=torch.bool))  # none missed
    assert seen[full].all()  # a full block is seen at every pair
    assert full.any() and (partial | full).sum() < n * (n + 1) // 2  # and blocks nobody sees are skipped


def test_shared_prompt_micro_batches_count_each_prompt_once():
    ids, mask, pos, responses = grouped_batch([4, 7, 2], 3, [5, 2, 9, 4, 1, 6, 3, 8, 2])
    width = ids.shape[1] - responses.shape[1]
    chunks = micro_batches(mask, 20, True, group_size=3, prompt_width=width)
    assert sorted(r for c in chunks for r in c.tolist()) == list(range(9))

    def shared(rows):  # a micro-batch's tokens with each group's prompt once
        groups = {int(r) // 3 for r in rows}
        return int(mask[rows, width:].sum() + sum(mask[3 * g, :width].sum() for g in groups))
    # groups of 4+16, 7+11 and 2+13 tokens, shared: each fits the budget and stays whole
    assert sorted(sorted(c.tolist()) for c in chunks) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [shared(c) for c in chunks] == [20, 18, 15]
    # a group over the budget splits, each part with its own copy of the prompt
    chunks = micro_batches(mask, 12, True, group_size=3, prompt_width=width)
    assert sorted(r for c in chunks for r in c.tolist()) == list(range(9))
    assert all(shared(c) <= 12 or len(c) == 1 for c in chunks)  # a row over the budget runs alone
    # the parts: rows 0-1 (4+5+2), 2 (4+9), 3-4 (7+4+1), 5 (7+6), 6 (2+3), 7-8 (2+8+2)
    assert sorted(sorted(c.tolist()) for c in chunks) == [[0, 1], [2], [3, 4], [5], [6], [7, 8]]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="inductor on the CPU needs a C compiler")
def test_compiled_layers_train_like_eager_ones(model_dir):
    """compile_layers runs the same math: one step's loss, gradients and the next forward agree."""
    ids, mask, pos, responses = padded_batch([3, 7, 1, 5], [6, 2, 9, 4])
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        engine = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu",
                             compile_layers=compiled)

        def loss(root=engine.root):
            logp, ent = forward_logprobs(root, ids, mask, pos, responses, 0.7, True)
            return -(logp.sum() + 0.1 * ent.sum()) / mask.sum()
        result = step_over(engine, [loss])
        with torch.no_grad():
            after, _ = forward_logprobs(engine.root, ids, mask, pos, responses, 0.7, False)
        runs.append((result["loss"], result["grad_norm"], after))
    (loss0, norm0, after0), (loss1, norm1, after1) = runs
    assert loss1 == pytest.approx(loss0, rel=1e-5) and norm1 == pytest.approx(norm0, rel=1e-4)
    torch.testing.assert_close(after1, after0, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_and_entropy_match_full_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(13, 16, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    logits = head(hidden) / 0.8
    full = algos.token_logprobs(logits, targets), algos.entropy_from_logits(logits)
    want = torch.autograd.grad(full[0].sum() + full[1].sum(), [hidden, head.weight])
    rows: list[int] = []
    head.register_forward_hook(lambda _, args, out: rows.append(len(args[0])))
    chunked = chunked_token_stats(head, hidden, targets, 0.8, chunk=4)
    assert rows == [4, 3, 3, 3]  # as few chunks as fit, even: no one-row last chunk
    got = torch.autograd.grad(chunked[0].sum() + chunked[1].sum(), [hidden, head.weight])
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(got, want)


def test_lr_schedule():
    f = lr_lambda(2, 12, "cosine")
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(7) == pytest.approx(0.5) and f(12) == pytest.approx(0.0)
    assert lr_lambda(0, 10, "constant")(9) == 1.0


def step_over(engine, losses):
    """One optimizer step over micro-batch losses computed when called, as the losses run it."""
    with engine.step(len(losses)) as step:
        for loss in losses:
            step.backward(loss())
    return step.out


def sft_losses(engine, ids, per_micro, denom=None):
    """Summed-token cross-entropy over a fixed denominator (all of `ids`' targets unless given),
    split into micro-batches of `per_micro` rows."""
    denom = denom or float(ids[:, 1:].numel())

    def loss(rows):
        x = ids[rows]
        ones = torch.ones_like(x)
        logp, _ = forward_logprobs(engine.root, x, ones, ones.cumsum(1) - 1, x[:, 1:], 1.0, False, entropy=False)
        return -logp.sum() / denom

    return [lambda r=slice(i, i + per_micro): loss(r) for i in range(0, len(ids), per_micro)]


def test_one_micro_batch_of_8_equals_8_of_1_and_checkpointing_changes_nothing(model_dir):
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (8, 6))
    a = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    b = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    c = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu", checkpointing=True)
    assert c.model.model.gradient_checkpointing and not a.model.model.gradient_checkpointing
    out_a = step_over(a, sft_losses(a, ids, 8))
    for other, per_micro in ((b, 1), (c, 2)):  # c also recomputes its layers' activations in backward
        out = step_over(other, sft_losses(other, ids, per_micro))
        assert out_a["loss"] == pytest.approx(out["loss"], rel=1e-5)
        assert out_a["grad_norm"] == pytest.approx(out["grad_norm"], rel=1e-4)
        for (name, pa), pb in zip(a.model.named_parameters(), other.model.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-7, msg=name)
    # one rank keeps whole weights gathered between a step's micro-batches, never past its end or
    # after a no-grad forward (generation reads the shards; the optimizer stepped them)
    assert all(isinstance(p, DTensor) for p in b.model.parameters())
    with torch.no_grad():
        sft_losses(b, ids, 8)[0]()
    assert all(isinstance(p, DTensor) for p in b.model.parameters())


def test_non_finite_loss_skips_the_step(model_dir):
    engine = TrainEngine(str(model_dir), 1e-2, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")
    before = [p.detach().clone() for p in engine.model.parameters()]
    ids = torch.randint(3, 90, (2, 6))
    ones = torch.ones_like(ids)
    nan = [lambda: forward_logprobs(engine.root, ids, ones, ones.cumsum(1) - 1, ids[:, 1:], 1.0,
                                    False)[0].sum() * float("nan")]
    out = step_over(engine, nan)
    assert out["skipped_steps"] == 1 and out["consecutive_skips"] == 1
    assert all(torch.equal(p, q) for p, q in zip(before, engine.model.parameters()))


def _dp_worker(rank: int, world: int, port: int, model_dir: str, device: str, dtype: str, out: str) -> None:
    """Three optimizer steps on rank's rows of one fixed batch; rank 0 saves losses, grads, norms."""
    import torch.distributed as dist

    from rlflow.engine.train.fsdp import all_reduce_sum

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    engine = TrainEngine(model_dir, 1e-3, 0.0, 1.0, 0, 10, "constant", dtype, device)
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (8, 6))
    mine, per_micro = ids[rank::world], 1 if rank == 0 else 4  # unequal micro-batch counts over ranks
    losses, norms, grads = [], [], []
    for step in range(3):
        result = step_over(engine, sft_losses(engine, mine, per_micro, float(ids[:, 1:].numel())))
        losses.append(all_reduce_sum(result["loss"]))
        norms.append(result["grad_norm"])
        if step == 0:
            grads = [p.grad.full_tensor().float().cpu() for p in engine.root.parameters()]
    if rank == 0:
        torch.save({"losses": losses, "norms": norms, "grads": grads}, out)
    leave_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_fsdp_over_two_ranks_matches_one(model_dir, tmp_path, device):
    """FSDP2 over 2 ranks, each with half the rows and a different micro-batch count, trains like
    one rank with all of them: same losses over 3 steps, same first gradients (fp32 on CPU: float
    noise; bf16 on GPUs: bf16 tolerance)."""
    import torch.multiprocessing as mp

    dtype = "bfloat16" if device == "cuda" else "float32"
    runs = {}
    for world in (1, 2):
        out = str(tmp_path / f"world{world}.pt")
        mp.spawn(_dp_worker, args=(world, _free_port(), str(model_dir), device, dtype, out), nprocs=world)
        runs[world] = torch.load(out, weights_only=True)
    rtol, atol = (1e-5, 1e-7) if dtype == "float32" else (2e-2, 2e-3)
    torch.testing.assert_close(torch.tensor(runs[2]["losses"]), torch.tensor(runs[1]["losses"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(runs[2]["norms"]), torch.tensor(runs[1]["norms"]), rtol=10 * rtol, atol=0)
    for a, b in zip(runs[2]["grads"], runs[1]["grads"]):
        torch.testing.assert_close(a, b, rtol=10 * rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_reuses_its_pinned_buffers_and_round_trips_the_state(model_dir):
    """Every switch moves the same AdamW tensors through the same pinned buffers (no host memory
    growth per step), frees their device memory, and brings back the exact values; after a
    state load the new tensors get buffers of their own."""
    engine = TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "bfloat16", "cuda")
    ids = torch.randint(3, 90, (4, 6))
    step_over(engine, sft_losses(engine, ids, 2, float(ids[:, 1:].numel())))
    before = [t.clone() for t in engine._optimizer_tensors()]
    state_bytes = sum(t.numel() * t.element_size() for t in before)
    buffers = None
    for _ in range(3):
        on_device = torch.cuda.memory_allocated()
        engine.offload()
        assert torch.cuda.memory_allocated() <= on_device - state_bytes
        buffers = buffers or [h.data_ptr() for h in engine._host.values()]
        assert [h.data_ptr() for h in engine._host.values()] == buffers and len(buffers) == len(before)
        engine.onload()
        assert all(torch.equal(a, b) for a, b in zip(engine._optimizer_tensors(), before))
    engine.load_state_dict(engine.state_dict())
    engine.offload()
    engine.onload()
    assert all(torch.equal(a, b) for a, b in zip(engine._optimizer_tensors(), before))


def _sp_worker(rank: int, world: int, sp: int, port: int, model_dir: str, device: str, dtype: str,
               out: str) -> None:
    """Three optimizer steps on fixed rows, sequence-parallel in groups of `sp` ranks with
    activation checkpointing (a group's
    ranks get the same rows; with two groups, the second gets fewer micro-batches and runs an idle
    forward); rank 0 saves losses, norms, first gradients and no-grad logprobs/entropies."""
    import torch.distributed as dist

    from rlflow.engine.train.fsdp import all_reduce_sum, response_logprobs

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    # the SP run recomputes its layers in backward (activation checkpointing): the recomputation
    # must see the same mask and group as the forward
    engine = TrainEngine(model_dir, 1e-3, 0.0, 1.0, 0, 10, "constant", dtype, device, sp=sp, checkpointing=sp > 1)
    ids, mask, pos, responses = padded_batch([3, 7, 1, 5], [6, 2, 9, 4])
    ids, mask, pos = ids[:, 1:], mask[:, 1:], pos[:, 1:]  # 15 tokens: SP pads a 16th onto each row
    denom = float(mask[:, -responses.shape[1]:].sum())

    def loss(r):
        logp, ent = forward_logprobs(engine.root, ids[r], mask[r], pos[r], responses[r], 0.7, False)
        return -(logp.sum() + 0.1 * ent.sum()) / denom

    plans = {1: [[slice(0, 3), slice(3, 4)]], 2: [[slice(0, 2), slice(2, 3)], [slice(3, 4)]]}  # by group count
    mine = plans[world // sp][rank // sp]
    losses, norms, grads = [], [], []
    for step in range(3):
        result = step_over(engine, [lambda r=r: loss(r) for r in mine])
        losses.append(all_reduce_sum(result["loss"]))
        norms.append(result["grad_norm"])
        if step == 0:
            grads = [p.grad.full_tensor().float().cpu() for p in engine.root.parameters()]
    logp, ent = response_logprobs(engine.root, ids, mask, pos, responses, 0.7, 30, with_entropy=True)
    if rank == 0:
        valid = mask[:, -responses.shape[1]:].bool()
        torch.save({"losses": losses, "norms": norms, "grads": grads, "logp": logp, "ent": ent, "valid": valid}, out)
    leave_group()


@pytest.mark.parametrize("device,world", [("cpu", 2), ("cpu", 4), pytest.param("cuda", 2, marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_sequence_parallel_matches_one_rank(model_dir, tmp_path, device, world):
    """Ulysses SP in groups of 2 ranks (each half of every row's tokens, FSDP2 over all ranks;
    with 4 ranks, two data-parallel groups of unequal micro-batch counts) trains like one rank
    with whole rows: same losses over 3 steps, same first gradients, same no-grad logprobs and
    entropies, on rows with left and right padding of different lengths and a length that does
    not split evenly."""
    import torch.multiprocessing as mp

    dtype = "bfloat16" if device == "cuda" else "float32"
    runs = []
    for n, sp in ((1, 1), (world, 2)):
        out = str(tmp_path / f"world{n}.pt")
        mp.spawn(_sp_worker, args=(n, sp, _free_port(), str(model_dir), device, dtype, out), nprocs=n)
        runs.append(torch.load(out, weights_only=True))
    one, sp = runs
    rtol, atol = (1e-5, 1e-7) if dtype == "float32" else (2e-2, 2e-3)
    torch.testing.assert_close(torch.tensor(sp["losses"]), torch.tensor(one["losses"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(sp["norms"]), torch.tensor(one["norms"]), rtol=10 * rtol, atol=0)
    for a, b in zip(sp["grads"], one["grads"]):
        torch.testing.assert_close(a, b, rtol=10 * rtol, atol=atol)
    for key in ("logp", "ent"):
        torch.testing.assert_close(sp[key], one[key], rtol=10 * rtol, atol=10 * atol)
    valid = sp["valid"]  # both ranks' tokens are there, and no padding
    assert torch.all(sp["logp"][valid] < 0) and torch.all(sp["logp"][~valid] == 0)


def test_sequence_parallel_needs_sp_to_divide_the_kv_heads():
    from types import SimpleNamespace

    from rlflow.engine.train import ulysses

    ulysses.check_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ValueError, match="key/value heads \\(2\\)"):
        ulysses.check_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 4)


def test_step_metrics_reads_device_values_once_max_or_mean():
    stats = {"training/diff_max": [0.5, torch.tensor(2.0)], "actor/entropy": [torch.tensor(1.0), 2.0, 3.0]}
    assert step_metrics(stats) == {"training/diff_max": 2.0, "actor/entropy": 2.0}

"""Resharding from FSDP2 training shards into the native engine's tensor-parallel layout."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import leave_group
from transformers import AutoModelForCausalLM

from rlflow.engine.reshard import (
    Resharder,
    WeightBroadcast,
    blocks_for,
    full_tensors,
    owned_rows,
    push_weights,
    weight_shapes,
)
from rlflow.engine.rollout.model import TP, Cut, NativeCausalLM


def test_blocks_cover_each_needed_row_once_from_its_owner():
    """5 rows over 2 ranks (3 + 2): a rank needing rows 1..4 gets 1..2 from rank 0 and 3..4 from rank 1."""
    assert [owned_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert owned_rows(2, 4, 3) == (2, 2)  # more ranks than rows: the last ones hold nothing
    blocks = blocks_for("w", torch.Size([5, 4]), "fused", Cut(0, 1, 4, row=6), dst=1, world=2, sharded=True)
    assert [(b.src, b.rows, b.row) for b in blocks] == [(0, (1, 3), 6), (1, (3, 5), 8)]
    cols = blocks_for("w", torch.Size([5, 4]), "o", Cut(1, 2, 2), dst=0, world=2, sharded=True)
    assert [(b.src, b.rows, b.cols, b.numel(torch.Size([5, 4]))) for b in cols] == [(0, (0, 3), (2, 4), 6),
                                                                                   (1, (3, 5), (2, 4), 4)]


def test_one_process_sync_equals_loading_full_tensors(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    rollout = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for p in rollout.parameters():
        p.data.fill_(float("nan"))
    Resharder(hf, rollout).sync()
    want = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for (name, got), ref in zip(rollout.named_parameters(), want.parameters()):
        assert torch.equal(got, ref), name


@pytest.mark.gpu
def test_a_sync_writes_weights_released_for_training(model_dir):
    """On CUDA the rollout's weights can be given back while training runs; the next sync maps
    them again at the same addresses (the decode graphs hold them) and writes them all."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda()
    rollout = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device="cuda")
    sync = Resharder(hf, rollout)
    at = [p.data_ptr() for p in rollout.parameters()]
    free = torch.cuda.mem_get_info()[0]
    rollout.release_weights()
    assert rollout.weights_lost and torch.cuda.mem_get_info()[0] - free >= rollout.weights.nbytes
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(-2)  # an update meanwhile
    sync.sync()
    assert not rollout.weights_lost and [p.data_ptr() for p in rollout.parameters()] == at
    want = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device="cuda")
    want.load_weights(hf.named_parameters())
    for (name, got), ref in zip(rollout.named_parameters(), want.parameters()):
        assert torch.equal(got, ref), name


def test_sync_follows_tensors_that_moved_since_the_last_one(model_dir):
    """A switch reuses its views of the shards and the rollout's parameters, until one moves (a
    new storage behind a trainer parameter or a rollout one): then the sync must still land the
    trainer's current values in the rollout's current tensors."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    rollout = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    resharder = Resharder(hf, rollout)
    resharder.sync()
    with torch.no_grad():
        for p in hf.parameters():
            p.data = torch.randn_like(p)  # new values in new storage
        for p in rollout.parameters():
            p.data = torch.full_like(p, float("nan"))
    resharder.sync()
    want = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    want.load_weights(hf.named_parameters())
    for (name, got), ref in zip(rollout.named_parameters(), want.parameters()):
        assert torch.equal(got, ref), name


def _worker(rank: int, port: int, model_dir: str, tp_size: int, out: str, device: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    mesh = init_device_mesh(device, (2,))
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    tp = TP(rank % tp_size, tp_size)
    rollout = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device=device, tp=tp)
    with torch.no_grad():
        for p in rollout.parameters():
            p.fill_(float("nan"))  # any weight the sync misses stays NaN
    resharder = Resharder(trainer, rollout, bucket_bytes=64 * 1024)  # several buckets
    resharder.sync()
    want = NativeCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device=device, tp=tp)
    mismatched = [n for (n, a), b in zip(rollout.named_parameters(), want.parameters()) if not torch.equal(a, b)]
    torch.save({"mismatched": mismatched, "received": resharder.bytes_received, "buckets": len(resharder.buckets),
                "rollout_bytes": sum(p.numel() * p.element_size() for p in rollout.parameters())}, f"{out}.{rank}")
    leave_group()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, two_gpus])])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fsdp_shards_reshard_bit_exactly_into_tensor_parallel_pieces(model_dir, tmp_path, tp_size, device):
    """Two ranks (gloo on CPU, NCCL on 2 GPUs), FSDP2 over both; rollout TP size 1 (each needs
    everything) or 2 (each its half). Every rollout weight starts as NaN and must end bit-equal
    to loading the full tensors."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(model_dir), tp_size, str(tmp_path / "out"), device), nprocs=2)
    for r in range(2):
        got = torch.load(tmp_path / f"out.{r}", weights_only=True)
        assert got["mismatched"] == []
        assert got["buckets"] > 1
        # a rank receives its rollout piece, never more (row-parallel biases are zero-filled locally)
        assert got["received"] <= got["rollout_bytes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_worker(rank: int, ports: tuple[int, int], model_dir: str, backend: str, out: str, device: str,
                  trainers: int, rollouts: int) -> None:
    """Ranks below `trainers`: the trainer, FSDP2 over their own group, weights moved off the model
    directory's; the `rollouts` others: rollout engines of NaN. One push, version 7, in buckets of
    64 KiB. On CUDA, rank r runs on GPU r."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoTokenizer

    from rlflow.engine.rollout.build import build_rollout

    if device == "cuda":
        torch.cuda.set_device(rank)
    rollout = lambda: build_rollout(backend, AutoTokenizer.from_pretrained(model_dir), model_dir, "bfloat16",  # noqa: E731
                                    device, 64, 4, 0.3)
    model = lambda engine: engine.model  # noqa: E731  # native and hf engines both keep theirs here
    trainer = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    shapes = weight_shapes(trainer)
    here = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    connect = lambda group_rank: WeightBroadcast("127.0.0.1", ports[1], group_rank, 1 + rollouts,  # noqa: E731
                                                 None if group_rank else shapes, torch.bfloat16, here,
                                                 bucket_bytes=64 * 1024)  # a receiver reads the plan from the store
    if rank < trainers:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}",
                                rank=rank, world_size=trainers)
        mesh = init_device_mesh(device, (trainers,))
        for layer in trainer.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(trainer, mesh=mesh)
        torch.manual_seed(rank)
        with torch.no_grad():
            for p in trainer.parameters():  # what the rollout must get is no longer on disk
                p.to_local().add_(torch.randn_like(p.to_local()) * 0.01)
        link = connect(0) if rank == 0 else None
        push_weights(trainer, link, 7)
        want = rollout()
        want.load_weights(full_tensors(trainer))  # collective, like the push
        if rank == 0:
            torch.save({"want": {n: p.cpu() for n, p in model(want).named_parameters()},
                        "buckets": len(link.buckets)}, f"{out}.want")
        dist.barrier()  # no trainer leaves while the other is still in a collective
    else:
        engine = rollout()
        with torch.no_grad():
            for p in model(engine).parameters():
                p.fill_(float("nan"))  # any weight the push misses stays NaN
        version = connect(rank - trainers + 1).receive(engine.load_weights)
        torch.save({"got": {n: p.cpu() for n, p in model(engine).named_parameters()}, "version": version},
                   f"{out}.{rank}")
    # The results are on disk. Leave without tearing the two groups down: each store's host may be
    # gone by then, and gloo's teardown racing it aborted a rank once on a loaded 2-core machine.
    os._exit(0)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, two_gpus])])
def test_push_to_a_rollout_pool_equals_loading_full_tensors(model_dir, tmp_path, backend, device):
    """Split placement's transport: FSDP2 trainer ranks push to rollout ranks in other processes
    (no shared default group) over a stand-alone group: on CPU 2 trainer ranks to 2 rollout ranks
    (gloo), on CUDA 1 GPU to 1 GPU (NCCL). Every rollout weight ends bit-equal to
    `load_weights(full_tensors(trainer))`, with the version the trainer sent."""
    trainers, rollouts = (2, 2) if device == "cpu" else (1, 1)
    mp.spawn(_split_worker, args=((_free_port(), _free_port()), str(model_dir), backend, str(tmp_path / "out"),
                                  device, trainers, rollouts), nprocs=trainers + rollouts)
    want = torch.load(tmp_path / "out.want", weights_only=True)
    assert want["buckets"] > 1
    for r in range(trainers, trainers + rollouts):
        got = torch.load(tmp_path / f"out.{r}", weights_only=True)
        assert got["version"] == 7
        assert list(got["got"]) == list(want["want"])
        mismatched = [n for n, w in want["want"].items() if not torch.equal(got["got"][n], w)]
        assert mismatched == []

"""Resharding from FSDP2 training shards into the native engine's tensor-parallel layout."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from engine.native_model import TP, Cut, NativeCausalLM
from engine.reshard import Resharder, blocks_for, owned_rows


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
    dist.destroy_process_group()


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

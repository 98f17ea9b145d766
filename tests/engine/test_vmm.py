"""StableBuffer on a GPU: memory given back and taken again at the same addresses, under a CUDA graph."""

import pytest
import torch

from rlflow.engine import vmm

pytestmark = pytest.mark.gpu


def test_release_frees_the_memory_and_restore_keeps_the_address():
    before = vmm.mapped_bytes()
    buf = vmm.StableBuffer(256 * 2**20, torch.device("cuda"))
    x = buf.view(torch.float32, (64, 2**20))  # [64, 1M] fp32: the whole buffer
    x.fill_(3.0)
    assert vmm.mapped_bytes() - before == buf.nbytes and x.sum().item() == 3.0 * x.numel()
    free = torch.cuda.mem_get_info()[0]
    buf.release()
    assert not buf.mapped and vmm.mapped_bytes() == before
    assert torch.cuda.mem_get_info()[0] - free >= buf.nbytes
    other = torch.empty(buf.nbytes, dtype=torch.uint8, device="cuda")  # torch may use it meanwhile
    buf.restore()
    assert buf.mapped and buf.view(torch.float32, (64, 2**20)).data_ptr() == x.data_ptr()
    x.fill_(5.0)
    assert x.sum().item() == 5.0 * x.numel()
    del other


def test_a_graph_replays_on_restored_memory():
    buf = vmm.StableBuffer(2**21, torch.device("cuda"))
    src = buf.view(torch.float32, (1024,))
    src.fill_(1.0)
    out = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(src * 2)
    buf.release()
    hold = torch.empty(2**22, dtype=torch.uint8, device="cuda")
    buf.restore()
    src.copy_(torch.arange(1024, dtype=torch.float32, device="cuda"))
    graph.replay()
    assert torch.equal(out, torch.arange(1024, dtype=torch.float32, device="cuda") * 2)
    del hold


def test_more_than_the_device_has_is_a_clear_out_of_memory_error():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.OutOfMemoryError, match="cuMemCreate"):
        vmm.StableBuffer(2 * total, torch.device("cuda"))

"""Model shapes the benchmarks build with random weights (no download): published Qwen2.5 configs,
plus `tiny` for CPU smoke runs (Qwen2.5's vocabulary, so token ids mean the same in every shape);
and what the multi-rank benches share: the random-model directory, a free port, a ranks' timer."""

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

QWEN25 = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def endless_model(shape: dict, device: str, dtype: torch.dtype):
    """(a model of `shape` with random weights (seed 0) on `device`, the embedded tokenizer), neither
    with an end token: every sequence runs to its token limit, so runs compared side by side do
    the same work."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlflow.engine.data.task import build_tokenizer

    tok = build_tokenizer()
    tok.eos_token = None
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, eos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval(), tok


def sync() -> None:
    """Wait for queued GPU work, so wall-clock timers measure it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str | torch.device) -> float:
    """Seconds `fn` takes on the default group's ranks, started together: the slowest rank's."""
    sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    sync()
    t = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def median_seconds(run: Callable[[], object]) -> float:
    """Seconds `run` takes on this device, warm: the median of 5 synchronized calls after one untimed."""
    run()
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def copy_tbps(device: str = "cuda") -> float:
    """This device's memory bandwidth in TB/s: bytes read + written per second by a 1 GiB copy
    (median of 5)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_seconds(lambda: dst.copy_(src)) / 1e12


def matmul_tflops(fp8: bool = False, n: int = 8192, device: str = "cuda") -> float:
    """This device's dense matmul rate in TFLOP/s: an n x n x n matmul in bf16, or in float8 e4m3
    through `torch._scaled_mm` with a scale per row, as an fp8 engine's projections run
    (engine/rollout/fp8.py); median of 5."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    if fp8:
        from rlflow.engine.rollout.fp8 import FAST_ACCUM, FP8
        a8, b8 = a.to(FP8), b.to(FP8).t()  # the second operand column-major, as a weight's transpose
        rows, cols = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

        def run() -> object:
            return torch._scaled_mm(a8, b8, scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16,
                                    use_fast_accum=FAST_ACCUM)
    else:
        def run() -> object:
            return a @ b
    return 2 * n**3 / median_seconds(run) / 1e12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(name: str, shape: dict, cache: Path) -> Path:
    """A random-weight HF directory of `shape` (bf16 safetensors and a tokenizer) under `cache`, made
    once per name and shape (benches name different shapes alike, e.g. "tiny")."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlflow.engine.data.task import build_tokenizer

    path = cache / f"{name}-{hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]}"
    if (path / "config.json").is_file():
        return path
    tok = build_tokenizer()
    cfg = Qwen2Config(**shape, max_position_embeddings=131072, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 7B random init on CPU takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    del model
    torch.cuda.empty_cache()
    return path


def profile(run: Callable[[], object], rank: int) -> None:
    """`run` once more under torch.profiler; rank 0 prints the ops that took the most device time
    (host time on CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    if rank == 0:
        key = "device_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)

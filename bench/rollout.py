"""Rollout throughput: the native engine against transformers' generate, side by side, same model.

    python bench/rollout.py --shape qwen2.5-0.5b --seqs 256 --prompt 128 --new 256

Random weights in the given model shape (no download), bf16 on the GPU (fp32 on CPU), random
prompt tokens, sampling at temperature 1, EOS ignored (`--new` tokens for every sequence, so
both engines do identical work). Each engine runs once to warm up (for native on CUDA that call
also captures the decode graphs), then `--repeats` timed runs (median). HF runs with its
dynamic and its static cache (`--hf-cache`). A last, synchronized native run gives the
per-phase breakdown; the roofline is decode's bytes (weights + the KV each step reads) over the
HBM bandwidth, measured in the same run by a 1 GiB device copy (`--hbm-tbps` overrides it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from shapes import QWEN25, TINY, copy_tbps, endless_model, sync  # bench/shapes.py (bench/ is sys.path[0])
from transformers import Qwen2Config

from engine.rollout.base import HFRollout, SamplingParams
from engine.rollout.model import NativeCausalLM
from engine.rollout.native import NativeRollout

SHAPES = {**QWEN25, "tiny": TINY}  # tiny: a CPU smoke run


def timed(engine, prompts, params, repeats: int) -> tuple[float, list[tuple[float, int]]]:
    """(warm-up seconds, [(seconds, generated tokens)] per timed run)."""
    start = time.perf_counter()
    engine.generate(prompts, params)  # the first call is several times slower
    sync()
    warm = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync()
        runs.append((time.perf_counter() - start, sum(len(c.token_ids) for g in out for c in g)))
    return warm, runs


def roofline(cfg: Qwen2Config, weights: int, seqs: int, prompt: int, new: int, itemsize: int,
             tbps: float) -> float:
    """Decode tokens/s if every step only read the weights and the live KV once from HBM."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    step_bytes = itemsize * (weights + seqs * (prompt + new / 2) * kv_per_token)
    return seqs * tbps * 1e12 / step_bytes


def profile(native: NativeRollout, mid_len: int) -> None:
    """Where decode's GPU time goes: the kernels of one CUDA-graph replay at full rows, every row
    `mid_len` tokens in (a graph that samples moves that on by one a replay)."""
    if not native.graphs:
        return
    rows = native.max_slots
    graph = native.graphs.get((rows, True)) or native.graphs[(rows, False)]
    native._kv_lens.fill_(mid_len)  # every row live, halfway through its response
    sync()
    start = time.perf_counter()
    for _ in range(50):
        graph.replay()
    sync()
    ms = (time.perf_counter() - start) / 50 * 1e3
    print(f"  decode graph replay at {rows} rows: {ms:.2f} ms; kernels of 10 replays:")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    native._kv_lens.zero_()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-cache", default="dynamic,static", help="comma list: dynamic, static, or none")
    ap.add_argument("--profile", action="store_true", help="time and kernel table of a decode graph replay")
    ap.add_argument("--hbm-tbps", type=float, help="HBM bandwidth for the roofline (default: measured by a copy)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # no EOS: every sequence generates exactly --new tokens in both engines
    hf_model, tok = endless_model(SHAPES[args.shape], device, dtype)
    cfg = hf_model.config
    prompts = torch.randint(100, cfg.vocab_size, (args.seqs, args.prompt)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=0)
    native = NativeRollout(NativeCausalLM.from_module(hf_model), tok, max_slots=args.seqs,
                           max_len=args.prompt + args.new)
    engines: dict = {"native": native}
    for cache in filter(lambda c: c in ("dynamic", "static"), args.hf_cache.split(",")):
        engines[f"hf {cache}"] = HFRollout(hf_model, tok, cache_implementation=cache)
    print(f"{args.shape}, {args.seqs} seqs x ({args.prompt} -> {args.new}), {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    results = {}
    for name, engine in engines.items():
        warm, runs = timed(engine, prompts, params, args.repeats)
        results[name] = statistics.median(n / s for s, n in runs)
        print(f"  {name:12s} {statistics.median(s for s, _ in runs):7.2f} s  {results[name]:10,.0f} tok/s"
              f"  (first call {warm:.2f} s)", flush=True)
    hf_best = max((v for k, v in results.items() if k.startswith("hf")), default=0.0)
    if hf_best:
        print(f"  native / best hf = {results['native'] / hf_best:.2f}x")
    native.phase_s = {}
    sync()
    start = time.perf_counter()
    native.generate(prompts, params)
    total = time.perf_counter() - start
    print(f"  native phases (synchronized run, {total:.2f} s): "
          + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in sorted(native.phase_s.items())))
    if args.profile and device == "cuda":
        profile(native, args.prompt + args.new // 2 - 30)  # 60 replays end halfway
    if device == "cuda":
        weights = sum(p.numel() for p in hf_model.parameters())
        tbps = args.hbm_tbps or copy_tbps()
        peak = roofline(cfg, weights, args.seqs, args.prompt, args.new, dtype.itemsize, tbps)
        print(f"  HBM {tbps:.2f} TB/s ({'given' if args.hbm_tbps else 'measured: 1 GiB device copy'}); "
              f"decode roofline ~{peak:,.0f} tok/s; native reaches {100 * results['native'] / peak:.0f}%, "
              f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()

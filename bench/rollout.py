"""Rollout throughput: the native engine against transformers' generate, side by side, same model.

    python bench/rollout.py --shape qwen2.5-0.5b --seqs 256 --prompt 128 --new 256
    python bench/rollout.py --shape qwen2.5-7b --native bf16,fp8 --hf-cache none --gap 32
    python bench/rollout.py --shape qwen2.5-0.5b --seqs 1024 --samples 8 --prompt 256 --new 256 --lengths mix

Random weights in the given model shape (no download), bf16 on the GPU (fp32 on CPU), random
prompt tokens, sampling at temperature 1, EOS ignored (`--new` tokens for every sequence, so
all engines do identical work). `--native` lists the native engine's weight dtypes to run
(fp8: engine/rollout/fp8.py, quantised from the same bf16 weights). Each engine runs once to
warm up (for native on CUDA that call also captures the decode graphs), then `--repeats` rounds
run every engine once each, interleaved so host drift hits all alike (median and range). HF
runs with its dynamic and its static cache (`--hf-cache`). A last, synchronized run of each
native engine gives the per-phase breakdown; the roofline is decode's bytes (weights + the KV
each step reads, and the step's logits once, in fp32) over the HBM bandwidth,
measured in the same run by a 1 GiB device copy (`--hbm-tbps` overrides it). A second line counts
arithmetic too: the step's matmuls take at least their FLOPs (2 a weight a row) at the rate of an
8192^3 matmul measured in the same run, where that is longer than reading the weights. It is, past
a few hundred rows: at 0.5B and 1,024 rows, or 7B and 256. `--gap N`: each native engine's
logprobs of N sampled sequences against a bf16 training forward (the HF model) over the same
tokens.

`--samples k` generates k samples of each of `--seqs / k` prompts, sharing each prompt's prefill
as GRPO does. `--slots M` runs at most M of the sequences at once (the rest wait for a slot), as
when the KV cache's memory limits them.

`--lengths mix` runs the length mix of bench/e2e.py (bench/length_mix.py): prompt lengths drawn up
to `--prompt`, each answer ending at its drawn length up to `--new` (the native
engines only: transformers' generate cannot end rows at their own lengths here), and reports the
step's generation floor (on CUDA): the prefill of its prompts as the engine runs it alone (a
call for one new token each), plus its longest answer's decode steps at one read of the weights
each; and a second floor that also reads each live row's KV and writes its logits once a step
(what a step over many rows cannot avoid); and a third that adds what a step's matmuls take beyond
reading the weights, at the measured matmul rate, where it has the rows to. A long tail holds a
step: the rows finish one by one while the longest keeps decoding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import replace

import torch
from length_mix import Mix, answer_length, patch_native, prompt_lengths
from shapes import QWEN25, TINY, copy_tbps, endless_model, matmul_tflops, sync  # bench/shapes.py, on sys.path
from transformers import Qwen2Config

from rlflow.engine.rollout import fp8
from rlflow.engine.rollout import scheduler as scheduler_module
from rlflow.engine.rollout.base import HFRollout, Request, SamplingParams
from rlflow.engine.rollout.model import NativeCausalLM
from rlflow.engine.rollout.native import NativeRollout
from rlflow.engine.tensors import left_pad
from rlflow.engine.train.fsdp import response_logprobs

SHAPES = {**QWEN25, "tiny": TINY}  # tiny: a CPU smoke run


def timed(engine, prompts, params) -> tuple[float, int]:
    """(seconds, generated tokens) of one generate call."""
    sync()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    sync()
    return time.perf_counter() - start, sum(len(c.token_ids) for g in out for c in g)


def long_prompt_stall(engine: NativeRollout, prompts, params, long: list[int], after: int) -> tuple[float, float]:
    """Serve `prompts` and, `after` engine steps in, one `long` prompt: (seconds in all, the longest
    engine step from its arrival on). A step is the time between two calls of the feed, which the
    engine makes between steps; each step waits for the one before it, so this is the longest any
    running sequence went without a token."""
    steps: list[float] = []
    todo = [Request(p, [(i, j) for j in range(params.n)]) for i, p in enumerate(prompts)]
    answered = False

    def feed(finished, wait):
        nonlocal answered
        steps.append(time.perf_counter())
        answered = answered or any(key == "long" for key, _ in finished)
        if len(steps) == 1:
            return todo
        return [Request(long, ["long"])] if len(steps) == after + 1 else None if answered else []

    sync()
    start = time.perf_counter()
    engine.serve(replace(params, n=1), feed)
    sync()
    gaps = [b - a for a, b in zip(steps[after:], steps[after + 1:])]
    return time.perf_counter() - start, max(gaps)


def kv_per_token(cfg: Qwen2Config) -> int:
    """K and V elements one token holds in the cache, all layers."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)


def matmul_params(cfg: Qwen2Config) -> tuple[int, int]:
    """(the decoder's projection weights, the lm_head's): what a decode step multiplies each row by,
    2 FLOPs a weight a row."""
    d = cfg.hidden_size // cfg.num_attention_heads
    q, kv, h = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.hidden_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * layer, cfg.vocab_size * h


def roofline(cfg: Qwen2Config, weight_bytes: int, seqs: int, prompt: int, new: int, kv_itemsize: int,
             tbps: float, matmul_s: float = 0.0) -> float:
    """Decode tokens/s if every step only read the weights and the live KV once from HBM and moved
    its logits once (fp32: at 1,024 rows and a 152k vocabulary, 0.6 GB). With `matmul_s`, the step's
    matrix multiplies take at least that long, whichever of their bytes and their FLOPs binds (all
    of them have about `seqs` FLOPs a byte of weights, so they sit on the same side of the ridge)."""
    logits_bytes = 4 * seqs * cfg.vocab_size
    rest = kv_itemsize * seqs * (prompt + new / 2) * kv_per_token(cfg) + logits_bytes
    return seqs / (max(weight_bytes / (tbps * 1e12), matmul_s) + rest / (tbps * 1e12))


def mix_decode_bytes(cfg: Qwen2Config, weight_bytes: int, prompt_lens: list[int], answers: list[int],
                     kv_itemsize: int) -> tuple[int, int, int]:
    """What the decode steps of a step of mixed lengths must move at least: (the weights, read once
    a step of the longest answer; each live row's KV, read once a step, a row of prompt p that is
    t tokens in holding p + t; each live row's logits, written once in fp32) in bytes."""
    kv = kv_itemsize * kv_per_token(cfg) * sum(a * p + a * (a - 1) // 2 for p, a in zip(prompt_lens, answers))
    return max(answers) * weight_bytes, kv, 4 * cfg.vocab_size * sum(answers)


def matmul_excess(answers: list[int], weight_s: float, row_s: float) -> float:
    """Seconds the decode steps' matmuls take beyond reading the weights, every row starting at step
    0: step t runs the rows whose answers are longer than t, `row_s` each at the peak rate."""
    ends = Counter(answers)
    rows, excess = len(answers), 0.0
    for t in range(max(answers)):
        excess += max(0.0, rows * row_s - weight_s)
        rows -= ends[t + 1]
    return excess


def logprob_gap(native: NativeRollout, hf_model, prompts: list[list[int]], new: int, pad: int) -> torch.Tensor:
    """|rollout logprob - training forward's| per sampled token [T]: `native` samples one response
    of `new` tokens per prompt (temperature 1), the HF model (bf16) scores the same tokens."""
    done = [g[0] for g in native.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=1))]
    pids, pmask = left_pad(prompts, pad)
    rids = torch.tensor([c.token_ids for c in done])  # no EOS: every response is max_new_tokens long
    mask = torch.cat([pmask, torch.ones_like(rids)], 1)
    logp, _ = response_logprobs(hf_model, torch.cat([pids, rids], 1).to(hf_model.device), mask.to(hf_model.device),
                                (mask.cumsum(1) - 1).clamp(min=0).to(hf_model.device), rids.to(hf_model.device),
                                1.0, 4096)
    return (logp.float().cpu() - torch.tensor([c.logprobs for c in done])).abs().flatten()


def profile(native: NativeRollout, mid_len: int) -> None:
    """Where decode's GPU time goes: the kernels of one CUDA-graph replay at full rows, every row
    `mid_len` tokens in (a graph that samples moves that on by one a replay)."""
    if not native.runner.graphs:
        return
    rows = native.runner.max_slots
    graph = native.runner.graphs.captured.get((rows, True)) or native.runner.graphs.captured[(rows, False)]
    native.runner.kv_lens.fill_(mid_len)  # every row live, halfway through its response
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
    rows_cost(native, mid_len)
    native.runner.kv_lens.zero_()


def rows_cost(native: NativeRollout, kv: int) -> None:
    """A decode step's time at each captured row count, every live row `kv` tokens in: a least-squares
    fit of a fixed part (what a step costs at any row count) plus a part per row; and how many
    kernels one replay at a single row runs, their busy time and the gaps between them."""
    sampled = any(s for _, s in native.runner.graphs.captured)
    times = {}
    for rows in native.runner.row_sizes:
        graph = native.runner.graphs.captured[(rows, sampled)]
        runs = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            for _ in range(20):
                native.runner.kv_lens[:rows] = kv  # a sampling replay moves each row on by one
                graph.replay()
            sync()
            runs.append((time.perf_counter() - start) / 20 * 1e3)
        times[rows] = statistics.median(runs)
    fit = statistics.linear_regression(list(times), list(times.values()))
    print(f"  decode step by rows at {kv} tokens a row (ms): " + " ".join(f"{r}:{t:.3f}" for r, t in times.items()))
    print(f"  fit: {fit.intercept:.3f} ms a step + {fit.slope * 1e3:.2f} us a row")
    native.runner.kv_lens.zero_()
    native.runner.kv_lens[:1] = kv
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            native.runner.kv_lens[:1] = kv
            native.runner.graphs.captured[(1, sampled)].replay()
        sync()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    span = (kernels[-1][1] - kernels[0][0]) / 10
    busy = sum(end - start for start, end in kernels) / 10
    print(f"  one row: {len(kernels) / 10:.0f} kernels a replay (the input write included), {busy:.0f} us busy, "
          f"{span - busy:.0f} us between them, under the profiler")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--samples", type=int, default=1, help="samples per prompt (one prefill each prompt)")
    ap.add_argument("--lengths", default="fixed", choices=["fixed", "mix"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--slots", type=int, help="sequences that run at once (default --seqs): fewer is the regime where "
                    "the KV cache's memory is what limits them")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--native", default="bf16", help="comma list of native engines: bf16, fp8 (weights), bf16-nomove "
                    "(no sequence moves to a lower slot as others retire), bf16-fifo (prompts prefilled in "
                    "the order they came, not shortest first), bf16-nofan (samples waiting for a slot prefill their "
                    "prompt again instead of copying a running sibling's)")
    ap.add_argument("--gap", type=int, default=0, help="sequences whose logprobs are checked against a bf16 forward")
    ap.add_argument("--hf-cache", default="dynamic,static", help="comma list: dynamic, static, or none")
    ap.add_argument("--profile", action="store_true", help="time and kernel table of a decode graph replay, and a "
                    "step's time by row count")
    ap.add_argument("--long", type=int, default=0, help="then serve the prompts once more with a prompt of this many "
                    "tokens arriving 16 steps in: the longest step after it, its chunks going in between decode "
                    "steps (--budget tokens a chunk) against all in one step")
    ap.add_argument("--budget", type=int, default=8192, help="the native engines' prefill tokens a step")
    ap.add_argument("--hbm-tbps", type=float, help="HBM bandwidth for the roofline (default: measured by a copy)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # no EOS: every sequence generates exactly --new tokens in both engines
    hf_model, tok = endless_model(SHAPES[args.shape], device, dtype)
    cfg = hf_model.config
    if args.seqs % args.samples:
        raise SystemExit(f"--samples {args.samples} must divide --seqs {args.seqs}")
    count = args.seqs // args.samples
    mix = Mix(seed=0, new=args.new) if args.lengths == "mix" else None
    lengths = prompt_lengths(count, args.prompt, seed=0) if mix else [args.prompt] * count
    ids = torch.Generator().manual_seed(0)  # its own: a CPU run draws the prompts a GPU run does
    prompts = [torch.randint(100, cfg.vocab_size, (n,), generator=ids).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, n=args.samples, seed=0)
    if mix:  # every native engine's sequences end at their drawn lengths; hf's could not
        patch_native(scheduler_module, mix)
        args.hf_cache = "none"
        answers = [answer_length(mix, p, j) for p in prompts for j in range(args.samples)]
        print(f"length mix: prompts {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / count:.0f}), "
              f"answers {min(answers)}-{max(answers)} (mean {sum(answers) / len(answers):.0f})")
    natives = {}  # "native" alone keeps the name earlier logs used
    for kind in args.native.split(","):
        weights = {"bf16": None, "bf16-nomove": None, "bf16-fifo": None, "bf16-nofan": None, "fp8": fp8.FP8}[kind]
        name = "native" if args.native == "bf16" else f"native {kind}"
        natives[name] = NativeRollout(NativeCausalLM.from_module(hf_model, dtype=weights), tok,
                                      max_slots=args.slots or args.seqs, max_len=max(args.prompt, args.long) + args.new,
                                      max_prefill_tokens=args.budget)
        natives[name].scheduler.MOVE = kind != "bf16-nomove"  # sequences stay in their slots until they end
        natives[name].scheduler.SORT = kind != "bf16-fifo"  # prompts prefilled in the order they came
        natives[name].scheduler.FAN = kind != "bf16-nofan"  # each sample prefills its prompt
    engines: dict = dict(natives)
    for cache in filter(lambda c: c in ("dynamic", "static"), args.hf_cache.split(",")):
        engines[f"hf {cache}"] = HFRollout(hf_model, tok, cache_implementation=cache)
    print(f"{args.shape}, {count} prompts x {args.samples} samples ({args.prompt} -> {args.new}"
          f"{', at most' if mix else ''}), {args.slots or args.seqs} slots, {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    warm = {name: timed(engine, prompts, params)[0] for name, engine in engines.items()}  # first calls: slow
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    for _ in range(args.repeats):  # rounds: every engine once, so host drift hits all alike
        for name, engine in engines.items():
            runs[name].append(timed(engine, prompts, params))
    if mix and any(n != sum(answers) for name in natives for _, n in runs[name]):
        raise SystemExit(f"the native engines did not generate the drawn {sum(answers)} tokens: {runs}")
    results = {}
    for name in engines:
        rates = [n / s for s, n in runs[name]]
        results[name] = statistics.median(rates)
        print(f"  {name:12s} {statistics.median(s for s, _ in runs[name]):7.2f} s  {results[name]:10,.0f} tok/s"
              f"  (range {min(rates):,.0f}-{max(rates):,.0f}; first call {warm[name]:.2f} s)", flush=True)
    first, *others = natives
    for name in others:  # each native engine's speed against the first listed, round by round
        ratios = [b_s / o_s for (b_s, _), (o_s, _) in zip(runs[first], runs[name])]
        print(f"  {name} / {first} = {statistics.median(ratios):.2f}x (per round: "
              + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    hf_best = max((v for k, v in results.items() if k.startswith("hf")), default=0.0)
    if hf_best:
        for name in natives:
            print(f"  {name} / best hf = {results[name] / hf_best:.2f}x")
    for name, native in natives.items():
        native.phase_s = {}
        counts = native.runner.padded, native.scheduler.fanned
        sync()
        start = time.perf_counter()
        native.generate(prompts, params)
        total = time.perf_counter() - start
        print(f"  {name} phases (synchronized run, {total:.2f} s): "
              + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in sorted(native.phase_s.items()))
              + f"; {native.runner.padded - counts[0]:,} tokens prefilled (padding included), "
              f"{native.scheduler.fanned - counts[1]} samples took a sibling's prompt")
        if args.profile and device == "cuda":
            profile(native, args.prompt + args.new // 2 - 30)  # 60 replays end halfway
    for name, native in natives.items() if args.long else ():
        long = torch.randint(100, cfg.vocab_size, (args.long,), generator=ids).tolist()
        for budget in (args.budget, args.long) * 2:  # the second of each counts: the first meets new shapes
            # args.long: all of it in one step, as before chunks alternated (what is admitted, and each chunk)
            native.scheduler.max_prefill_tokens = budget
            if budget == args.budget:
                chunked = long_prompt_stall(native, prompts, params, long, 16)
            else:
                whole = long_prompt_stall(native, prompts, params, long, 16)
        native.scheduler.max_prefill_tokens = args.budget
        print(f"  {name}: a {args.long}-token prompt 16 steps in: in chunks of {args.budget}, {chunked[0]:.2f} s and "
              f"{1e3 * chunked[1]:.1f} ms at most between two steps; whole, {whole[0]:.2f} s and "
              f"{1e3 * whole[1]:.1f} ms", flush=True)
    for name, native in natives.items() if args.gap else ():
        gap = logprob_gap(native, hf_model, prompts[:args.gap], args.new, tok.pad_token_id)
        print(f"  {name} vs bf16 training forward, {args.gap} x {args.new} sampled tokens: mean |dlogprob| "
              f"{gap.mean():.2e}, p99 {gap.quantile(0.99):.2e}, max {gap.max():.2e}", flush=True)
    if device == "cuda":
        engines_peak = torch.cuda.max_memory_allocated()  # before the copy and the matmul below allocate theirs
        tbps = args.hbm_tbps or copy_tbps()
        tflops: dict[bool, float] = {}  # the measured matmul rate, by whether it is fp8
        for name, native in natives.items():
            weight_bytes = sum(p.numel() * p.element_size() for p in native.model.parameters())
            quantized = any(p.dtype == fp8.FP8 for p in native.model.parameters())
            for kind in {False, quantized}:
                tflops.setdefault(kind, matmul_tflops(fp8=kind))
            projections, head = matmul_params(cfg)  # an fp8 engine's lm_head stays bf16
            row_s = 2 * (projections / tflops[quantized] + head / tflops[False]) / 1e12  # a row's matmuls at the peak
            rate = f"{tflops[quantized]:.0f} TFLOP/s ({'fp8' if quantized else 'bf16'}, measured: an 8192^3 matmul)"
            if mix:  # the step's floor: its prefill alone, then one weight read per step of the longest answer
                prefill = statistics.median(timed(native, prompts, replace(params, max_new_tokens=1))[0]
                                            for _ in range(3))
                floor = prefill + max(answers) * weight_bytes / (tbps * 1e12)
                gen = statistics.median(s for s, _ in runs[name])
                print(f"  {name}: generation {gen:.3f} s against a floor of {floor:.3f} s ({gen / floor:.2f}x): "
                      f"prefill alone {prefill:.3f} s + {max(answers)} decode steps at {weight_bytes / 1e9:.2f} GB "
                      f"of weights a step, {tbps:.2f} TB/s", flush=True)
                moved = mix_decode_bytes(cfg, weight_bytes, [len(p) for p in prompts for _ in range(args.samples)],
                                         answers, dtype.itemsize)
                floor = prefill + sum(moved) / (tbps * 1e12)
                print(f"  {name}: against a floor that also reads each live row's KV ({moved[1] / 1e9:.1f} GB) and "
                      f"writes its logits ({moved[2] / 1e9:.1f} GB) once a step: {floor:.3f} s ({gen / floor:.2f}x)")
                if not args.slots or args.slots >= len(answers):  # every row from the first step on
                    floor += matmul_excess(answers, weight_bytes / (tbps * 1e12), row_s)
                    print(f"  {name}: and where a step's matmuls at {rate} outlast its weights' read, the "
                          f"matmuls: {floor:.3f} s ({gen / floor:.2f}x)")
                continue
            rows = args.slots or args.seqs
            peak = roofline(cfg, weight_bytes, rows, args.prompt, args.new, dtype.itemsize, tbps)
            print(f"  HBM {tbps:.2f} TB/s ({'given' if args.hbm_tbps else 'measured: 1 GiB device copy'}); {name}: "
                  f"weights {weight_bytes / 1e9:.2f} GB, decode roofline ~{peak:,.0f} tok/s, reaches "
                  f"{100 * results[name] / peak:.0f}%")
            peak = roofline(cfg, weight_bytes, rows, args.prompt, args.new, dtype.itemsize, tbps, rows * row_s)
            print(f"  {name}, counting arithmetic too: the step's matmuls need {1e3 * rows * row_s:.2f} ms at {rate}, "
                  f"the weights' bytes {1e3 * weight_bytes / (tbps * 1e12):.2f} ms; roofline ~{peak:,.0f} tok/s, "
                  f"reaches {100 * results[name] / peak:.0f}%")
        print(f"  peak memory {engines_peak / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()

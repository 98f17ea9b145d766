"""Rollout throughput: the native engine against transformers' generate, side by side, same model.

    python bench/rollout.py --shape qwen2.5-0.5b --seqs 256 --prompt 128 --new 256

Random weights in the given model shape (no download), bf16 on the GPU (fp32 on CPU), random
prompt tokens, sampling at temperature 1. With random weights the stop token is one of ~150k
equally likely tokens, so nearly every sequence runs to `--new` tokens; tokens/s counts the
tokens actually generated. Each engine runs once to warm up, then `--repeats` timed runs (median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from engine.native import NativeRollout
from engine.native_model import NativeCausalLM
from engine.rollout import HFRollout, SamplingParams
from engine.task import build_tokenizer

SHAPES = {  # published Qwen2.5 configs
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def timed(engine, prompts, params, repeats: int) -> list[tuple[float, int]]:
    """(seconds, generated tokens) per timed run."""
    engine.generate(prompts, params)  # warm-up: the first call is several times slower
    runs = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - start, sum(len(c.token_ids) for g in out for c in g)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = build_tokenizer()
    cfg = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    prompts = torch.randint(100, cfg.vocab_size, (args.seqs, args.prompt)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=0)
    engines = {
        "hf generate": HFRollout(hf_model, tok),
        "native": NativeRollout(NativeCausalLM.from_module(hf_model), tok, max_slots=args.seqs,
                                max_len=args.prompt + args.new),
    }
    print(f"{args.shape}, {args.seqs} seqs x ({args.prompt} -> {args.new}), {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    results = {}
    for name, engine in engines.items():
        runs = timed(engine, prompts, params, args.repeats)
        results[name] = statistics.median(n / s for s, n in runs)
        print(f"  {name:12s} {statistics.median(s for s, _ in runs):7.2f} s  {results[name]:10,.0f} tok/s")
    print(f"  native / hf = {results['native'] / results['hf generate']:.2f}x")


if __name__ == "__main__":
    main()

"""The seconds each phase of an rlflow GRPO step cannot beat on this device (bench/e2e.py prints
them beside each phase's median), from the step's drawn lengths, the bf16 matmul weights
(embeddings are a lookup; the lm_head counts at answer positions only; attention's own FLOPs are
left out) and two rates measured once before the jobs (bench/shapes.py: a 1 GiB device copy, an 8192^3 bf16 matmul):
generation is the prompts' prefill (each prompt once) at the matmul rate, then the longest
answer's decode steps, each reading the weights once or doing its live rows' matmuls, whichever is
longer, plus reading each live row's KV and writing its logits (bench/rollout.py's decode floor);
old logprobs (and the reference), where they run, one forward, 2 FLOPs a weight a token; the
update 6 (3 passes), or 4 with LoRA (a forward and the input-gradient backward through the frozen
base; the adapters' FLOPs neglected), so its MFU is the floor over its time, of the measured matmul
rate (not the datasheet's peak). The forward that activation checkpointing recomputes is not
counted: the floor is a step without it. The step's floor is the sum of its phases'.
"""

from __future__ import annotations

import statistics
from typing import Any


def phase_floors(cfg: Any, prompts: list[int], answers: list[int], lora: bool,
                 rates: dict[str, float]) -> dict[str, float]:
    """Seconds each phase of a step takes at least, as the module docstring counts them: `prompts`
    the step's prompt lengths, `answers` its answer lengths row by row (each prompt's samples together)."""
    from rollout import matmul_excess, matmul_params, mix_decode_bytes  # bench/rollout.py's decode floor

    decoder, head = matmul_params(cfg)
    hbm, flops = rates["tbps"] * 1e12, rates["tflops"] * 1e12
    matmul_s = lambda tokens, answered: 2 * (decoder * tokens + head * answered) / flops  # noqa: E731
    rows = [p for p in prompts for _ in range(len(answers) // len(prompts))]
    weights = 2 * (decoder + head)  # the bf16 bytes a decode step reads
    decode = sum(mix_decode_bytes(cfg, weights, rows, answers, 2)) / hbm + \
        matmul_excess(answers, weights / hbm, matmul_s(1, 1))
    forward = matmul_s(sum(rows) + sum(answers), sum(answers))
    return {"gen_s": matmul_s(sum(prompts), 0) + decode, "old_log_prob_s": forward, "ref_s": forward,
            "update_s": (2 if lora else 3) * forward}


def against_floors(r: dict, floors: dict[str, float], warmup: int) -> dict[str, dict[str, float]]:
    """Each phase's median, min and max over the timed steps beside its floor and their ratio; the
    step's beside the sum of its phases' floors. A phase that did not run has no floor: on-policy the
    update's own forward gives the old logprobs (stages/policy.py), and that phase takes microseconds."""
    timed = r["steps"][warmup:]
    out = {k: dict(median_s=statistics.median(s[k] for s in timed), min_s=min(s[k] for s in timed),
                   max_s=max(s[k] for s in timed), floor_s=floors[k]) for k in floors if k in timed[0]}
    out = {k: v for k, v in out.items() if v["median_s"] > 0.01 * v["floor_s"]}
    out["step_s"] = dict(median_s=r["step_s"], min_s=min(s["step_s"] for s in timed),
                         max_s=max(s["step_s"] for s in timed), floor_s=sum(v["floor_s"] for v in out.values()))
    for v in out.values():
        v["ratio"] = v["median_s"] / v["floor_s"]
    return out


def print_floors(r: dict, rates: dict[str, float]) -> None:
    print(f"  rlflow {r['mode']} against its floors (HBM {rates['tbps']:.2f} TB/s, bf16 matmul "
          f"{rates['tflops']:.0f} TFLOP/s, both measured): median (min-max) / floor")
    for k, v in r["floors"].items():
        print(f"    {k[:-2] if k != 'step_s' else 'step (sum)':14s} {v['median_s']:8.3f} s ({v['min_s']:.3f}-"
              f"{v['max_s']:.3f}) / {v['floor_s']:8.3f} s = {v['ratio']:.2f}x")
    print(f"    update MFU {r['update_mfu']:.0%} of the measured matmul rate ({r['update_flops']} x params x tokens)",
          flush=True)

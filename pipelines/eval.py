"""Evaluate a policy: one greedy and k sampled answers per prompt, scored, summarised, tracked.

For every prompt of `data.val_files` (the first `data.val_max_prompts` of them, as training's
validation takes; 0 = all) the model answers once greedily and k times by sampling
(k = `rollout.samples_per_prompt`, with the rollout's temperature, top-p and top-k). Each answer
is scored by the configured reward (`reward.function`, or the built-in scorer of its
`data_source`); an answer is correct when its score is at least 1.0. Reported overall and per
data_source:
- `accuracy`: the fraction of greedy answers that are correct;
- `mean_at_<k>`: the mean score of the sampled answers (mean@k);
- `pass_at_<j>` for j = 1, 2, 4, ..., k: the unbiased pass@j estimate from the k samples.

The same rollout engine, prompt loader and reward functions as training, in this one process
(on the GPU when there is one); no Ray. The results go to their own MLflow run, tagged
`job=eval`, as metrics `eval/<data_source>/<name>` and `eval/<name>`, with one row per prompt in
the `eval/prompts.json` table.

Run: `rlflow eval CHECKPOINT|OUTPUT_DIR|HF_DIR [CONFIG.yaml] [key=value ...]`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from engine.algos import pass_at_k
from engine.config import Config
from engine.data.prompts import Prompt, load_prompts
from engine.data.rewards import RewardFunction
from engine.rollout.base import RolloutEngine, SamplingParams
from engine.rollout.build import build_rollout
from engine.tracking import Tracker


def answer(rollout: RolloutEngine, tokenizer: Any, reward: RewardFunction, prompts: list[Prompt],
           params: SamplingParams, chunk: int) -> tuple[list[list[str]], list[list[float]], float]:
    """(responses [P][n], scores [P][n], reward errors), generating `chunk` prompts at a time."""
    texts: list[list[str]] = []
    scores: list[list[float]] = []
    errors = 0.0
    for lo in range(0, len(prompts), chunk):
        part = prompts[lo:lo + chunk]
        groups = rollout.generate([p.ids for p in part], replace(params, seed=params.seed + lo))
        decoded = [tokenizer.batch_decode([c.token_ids for c in g], skip_special_tokens=True) for g in groups]
        rows = [(p, text) for p, texts_of in zip(part, decoded) for text in texts_of]
        flat, metrics, _ = reward([p.data_source for p, _ in rows], [t for _, t in rows],
                                  [p.ground_truth for p, _ in rows], [p.extra_info for p, _ in rows])
        errors += metrics["reward/errors"]
        texts += decoded
        scores += [flat[i * params.n:(i + 1) * params.n] for i in range(len(part))]
    return texts, scores, errors


def summarise(sources: list[str], greedy: list[float], sampled: list[list[float]]) -> dict[str, float]:
    """accuracy, mean_at_k and pass_at_j per data_source ("eval/<source>/...") and overall ("eval/...")."""
    n = len(sampled[0])
    ks = sorted({j for j in (2**i for i in range(n.bit_length())) if j <= n} | {n})
    groups: dict[str, list[int]] = {"eval/": list(range(len(sources)))}
    for i, source in enumerate(sources):
        groups.setdefault(f"eval/{source}/", []).append(i)
    out = {}
    for prefix, rows in groups.items():
        out[f"{prefix}prompts"] = float(len(rows))
        out[f"{prefix}accuracy"] = sum(greedy[i] >= 1.0 for i in rows) / len(rows)
        out[f"{prefix}mean_at_{n}"] = sum(sum(sampled[i]) / n for i in rows) / len(rows)
        for k in ks:
            out[f"{prefix}pass_at_{k}"] = sum(pass_at_k(n, sum(s >= 1.0 for s in sampled[i]), k)
                                              for i in rows) / len(rows)
    return out


def evaluate(cfg: Config, model_dir: Path, files: list[str], tracker: Tracker) -> dict[str, float]:
    """Score `model_dir` on `files`; logs and returns the metrics."""
    r = cfg.rollout
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = build_rollout(r.backend, tokenizer, str(model_dir), r.dtype, device,
                            cfg.data.max_prompt_tokens + r.max_new_tokens,
                            cfg.data.prompts_per_step * r.samples_per_prompt, r.kv_cache_memory)
    prompts, counts = load_prompts(files, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts)
    prompts = prompts[:cfg.data.val_max_prompts or None]
    reward = RewardFunction(cfg.reward.function, cfg.reward.on_error, cfg.reward.timeout_s)
    greedy = SamplingParams(temperature=0.0, n=1, max_new_tokens=r.max_new_tokens, stop_strings=r.stop_strings)
    sampled = replace(greedy, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.samples_per_prompt,
                      seed=cfg.trainer.seed)
    chunk = cfg.data.prompts_per_step
    greedy_texts, greedy_scores, greedy_errors = answer(rollout, tokenizer, reward, prompts, greedy, chunk)
    _, sampled_scores, sampled_errors = answer(rollout, tokenizer, reward, prompts, sampled, chunk)
    metrics = summarise([p.data_source for p in prompts], [s[0] for s in greedy_scores], sampled_scores)
    metrics["eval/reward_errors"] = greedy_errors + sampled_errors
    tracker.log_metrics({**metrics, **{f"data/{k}": v for k, v in counts.items()}}, step=0)
    tracker.log_table([{"prompt": p.text, "data_source": p.data_source, "ground_truth": p.ground_truth,
                        "greedy_response": t[0], "greedy_score": g[0], "sampled_correct": sum(x >= 1.0 for x in s),
                        "samples": len(s)}
                       for p, t, g, s in zip(prompts, greedy_texts, greedy_scores, sampled_scores)],
                      "eval/prompts.json")
    return metrics

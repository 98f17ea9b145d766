"""DPO from preference pairs to gradients, on Ray, tracked in MLflow.

Algorithm (Rafailov et al., 2023): for a prompt x with a chosen answer c and a rejected one r,
minimise -log sigmoid(beta * ((log pi(c|x) - log ref(c|x)) - (log pi(r|x) - log ref(r|x)))),
log-probabilities summed over each answer's tokens, `ref` the frozen starting policy. The implicit
reward of an answer is beta * (log pi - log ref); its chosen-minus-rejected margin and how often it
is positive (`reward_accuracy`) are what the run tracks, on the training pairs (`dpo/*`, measured
in the step's forward, before that mini-batch's update) and on held-out pairs (`val/*`). Dropped:
label smoothing / IPO / conservative variants, an added SFT term, and precomputed reference
logprobs (the reference recomputes them each step, next to the actor, as in GRPO's KL path).

One step, per data-parallel rank (`step_graph`):
    pairs -> reference.logprobs -> actor.dpo_update
compiled into a Ray compiled graph (`trainer.dag=compiled`) or run as `.remote()` calls (`plain`).
Validation, checkpoints and logging stay in the driver, between executions. With the embedded
model, the warm start is supervised training on the training pairs' chosen answers; on the
embedded pairs those are the GRPO default's warm-start examples, in the same order.

Invariants:
- a pair's two rows (chosen, then rejected: group_size 2) stay on one rank and in one micro-batch;
- metrics are means over the pairs of every rank: the ranks return sums, the driver divides;
- a resumed run continues from the checkpoint's weights, optimizer and loader position.

Run: `rlflow dpo [conf/dpo.yaml] [key=value ...]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from transformers import AutoTokenizer

from engine.batch import Batch
from engine.config import Config
from engine.data.prompts import Pair, PromptLoader, load_pairs, pairs_batch
from engine.tracking import Tracker
from pipelines.driver import Stages, even_cut, run
from pipelines.sft import supervised


def step_graph(stages: Stages, inputs: list[Any], call: Callable, verb: str = "dpo_update") -> list[Any]:
    """One chain per rank; `call` binds (compiled DAG) or submits (plain). `verb`: dpo_update or dpo_eval."""
    outputs = []
    for rank, batch in enumerate(inputs):
        batch = call(stages.worker("reference", rank).run, "reference", "logprobs", batch)  # the frozen anchor
        outputs.append(call(stages.worker("actor", rank).run, "actor", verb, batch))  # DPO loss, optimizer steps
    return outputs


def shard(pairs: list[Pair], workers: int, pad_id: int) -> list[Batch]:
    """Contiguous equal shards of whole pairs, one Batch per rank."""
    size = len(pairs) // workers
    return [pairs_batch(pairs[i * size:(i + 1) * size], pad_id) for i in range(workers)]


def merge(results: list[dict], prefix: str) -> dict[str, float]:
    """`<prefix>/<stat>`: each per-pair statistic averaged over every rank's pairs; timings (slowest rank)."""
    pairs = sum(r["pairs"] for r in results)
    out = {f"{prefix}/{k}": sum(r["sums"][k] for r in results) / pairs for k in results[0]["sums"]}
    out.update(results[0].get("metrics", {}))  # optimizer numbers: the same on every rank after the all-reduce
    for k in results[0]["timing"]:
        out[f"timing_s/{k}"] = max(r["timing"][k] for r in results)
    return out


def validate(stages: Stages, batches: list[Batch]) -> dict[str, float]:
    """`val/loss`, `val/reward_margin`, `val/reward_accuracy`, `val/chosen_reward`, `val/rejected_reward`."""
    submit = lambda method, *args: method.remote(*args)  # noqa: E731
    results = ray.get(step_graph(stages, batches, submit, "dpo_eval"), timeout=stages.timeout)
    return {k: v for k, v in merge(results, "val").items() if not k.startswith("timing_s/")}


def load(cfg: Config, model_path: str, files: list[str]) -> tuple[list[Pair], dict[str, int], int]:
    """The usable pairs of `files`, skip counts, and the pad token id."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs, counts = load_pairs(files, tokenizer, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens,
                               cfg.data.overlong_prompts)
    return pairs, counts, tokenizer.pad_token_id


def warm_start(cfg: Config, model_path: str, train_files: list[str], tracker: Tracker) -> str:
    """`warmstart.steps` supervised steps on the training pairs' chosen answers; returns the HF directory."""
    pairs, _, _ = load(cfg, model_path, train_files)
    return supervised(cfg, model_path, [(p.prompt, p.chosen) for p in pairs], tracker)


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The DPO loop; returns the exported HF directory of the final policy."""
    t, workers = cfg.trainer, cfg.placement.workers
    # the reference scores at temperature 1, the models' own distributions
    cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=1.0))
    train_pairs, counts, pad_id = load(cfg, model_path, files["train"])
    val_pairs, _, _ = load(cfg, model_path, files["val"])
    val_pairs = val_pairs[:cfg.data.val_max_prompts or None]
    val_pairs, counts["val_left_out"] = even_cut(val_pairs, workers, "validation pairs")
    val = shard(val_pairs, workers, pad_id)
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_pairs, cfg.data.prompts_per_step, t.seed)

    def step(run_step: Callable, pairs: list[Pair]) -> dict[str, float]:
        begin = time.perf_counter()
        metrics = merge(run_step(shard(pairs, workers, pad_id)), "dpo")
        metrics["timing_s/step"] = time.perf_counter() - begin
        return metrics

    stages = Stages(cfg, model_path, reference=True)
    return run(cfg, stages, step_graph, loader, tracker, step, lambda: validate(stages, val),
               lambda m: f"loss {m['dpo/loss']:.4f} margin {m['dpo/reward_margin']:.4f} "
                         f"accuracy {m['dpo/reward_accuracy']:.3f}")

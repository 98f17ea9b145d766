"""Supervised fine-tuning on prompt -> answer pairs; the embedded default's warm-start.

The target response of a prompt row is its `reward_model.ground_truth` followed by EOS, which suits
tasks whose ground truth is the whole answer (the embedded arithmetic task); DPO warm-starts on
its pairs' chosen answers instead (`supervised`). The loss is
next-token cross-entropy on response tokens only, through the same actor stage and training
engine the RL pipeline uses. The result is an ordinary HF directory that RL starts from.

Invariants:
- the warm-start directory appears only complete (written to a temp dir, then renamed), so a
  resumed run reuses it instead of training it again;
- batches are drawn with a generator seeded from `trainer.seed`.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import replace
from pathlib import Path

import ray
from transformers import AutoTokenizer

from engine.config import Config
from engine.data import load_prompts
from engine.placement import Pool
from engine.tracking import Tracker
from stages.actor import ActorRollout
from stages.worker import StageWorker


def warm_start(cfg: Config, model_path: str, train_files: list[str], tracker: Tracker) -> str:
    """Train `warmstart.steps` supervised steps from `model_path` on the prompt rows' ground-truth
    answers; returns the new HF directory."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts, _ = load_prompts(train_files, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts)
    examples = [(p.ids, tokenizer.encode(p.ground_truth, add_special_tokens=False) + [tokenizer.eos_token_id])
                for p in prompts]
    return supervised(cfg, model_path, examples, tracker)


def supervised(cfg: Config, model_path: str, examples: list[tuple[list[int], list[int]]], tracker: Tracker) -> str:
    """`warmstart.steps` supervised steps on (prompt ids, response ids) examples; returns the HF
    directory `<output_dir>/warmstart`, reused when it is already there."""
    w, target = cfg.warmstart, Path(cfg.trainer.output_dir) / "warmstart"
    if (target / "config.json").is_file():
        print(f"warm-start: reusing {target}")
        return str(target)
    # warm start never generates: the shared-module hf engine costs nothing to build
    sft_cfg = replace(cfg, actor=replace(cfg.actor, lr=w.lr, warmup_steps=0, lr_schedule="constant"),
                      trainer=replace(cfg.trainer, total_steps=w.steps), rollout=replace(cfg.rollout, backend="hf"))
    pool = Pool("warmstart", StageWorker, 1, cfg.placement.gpus_per_worker, cfg.placement.torch_threads)
    try:
        device = "cuda" if cfg.placement.gpus_per_worker else "cpu"
        pool.add("actor", ActorRollout, lambda r: dict(cfg=sft_cfg, model_path=model_path, device=device))
        worker, rng = pool.workers[0], random.Random(cfg.trainer.seed)
        for step in range(w.steps):
            metrics = ray.get(worker.run.remote("actor", "sft_update", rng.sample(examples, w.batch_size)))
            if step % 10 == 0 or step == w.steps - 1:
                tracker.log_metrics({f"warmstart/{k.split('/')[-1]}": v for k, v in metrics.items()}, step=step)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        ray.get(worker.run.remote("actor", "export", str(tmp)))
        os.replace(tmp, target)
    finally:
        pool.shutdown()
    return str(target)

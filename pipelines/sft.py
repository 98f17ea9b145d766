"""Supervised fine-tuning from prompt -> response rows to gradients, on Ray, tracked in MLflow; also
the warm start the other pipelines run before RL or DPO.

Algorithm: minimise next-token cross-entropy on the response tokens only (the prompt is context),
a mean over every response token of the step's examples. A row holds `prompt` and `response`
(eos appended); a prompt row's `reward_model.ground_truth` serves as its response, which suits
tasks whose ground truth is the whole answer (the embedded arithmetic task). Dropped: packing
several examples into one training row across prompts, loss on prompt tokens, NEFTune noise.

One step (`sft_step`), `data.prompts_per_step` examples split into equal contiguous shards:
    examples -> actor.sft_update (one optimizer step, collective over the data-parallel ranks)
compiled into a Ray compiled graph (`trainer.dag=compiled`) or run as `.remote()` calls (`plain`).
`actor.mini_batch_prompts` and `actor.ppo_epochs` do not apply: one step is one optimizer step.
Validation (`val/sft/loss`, the mean response-token NLL of `data.val_files`), checkpoints and
logging stay in the driver, between executions.

The warm start (`supervised`) runs the same step on one worker for `warmstart.steps` steps of
`warmstart.batch_size` examples at a constant `warmstart.lr`, without validation or checkpoints.

Invariants:
- batches are drawn with generators seeded from `trainer.seed`: a `PromptLoader` (shuffled epochs,
  so a resumed run draws the same batches), and for the warm start independent samples;
- the warm-start directory appears only complete (written to a temp dir, then renamed), so a
  resumed run reuses it instead of training it again.

Run: `rlflow sft [conf/sft.yaml] [key=value ...]`.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from transformers import AutoTokenizer

from engine.config import Config
from engine.data.prompts import Example, PromptLoader, load_examples
from engine.tracking import Tracker
from pipelines.driver import Stages, even_cut, make_runner, run


def step_graph(stages: Stages, inputs: list[Any], call: Callable, verb: str = "sft_update") -> list[Any]:
    """One call per rank; `call` binds (compiled DAG) or submits (plain). `verb`: sft_update or sft_eval."""
    return [call(stages.worker("actor", rank).run, "actor", verb, shard) for rank, shard in enumerate(inputs)]


def shard(examples: list[Example], workers: int) -> list[list[Example]]:
    """Contiguous equal shards, one per rank."""
    size = len(examples) // workers
    return [examples[i * size:(i + 1) * size] for i in range(workers)]


def sft_step(run_step: Callable[[list[Any]], list[dict]], examples: list[Example], workers: int) -> dict[str, float]:
    """One optimizer step on `examples`: `sft/*` (the same on every rank after the all-reduce), its time
    and tokens/s/GPU."""
    begin = time.perf_counter()
    metrics = run_step(shard(examples, workers))[0]
    seconds = time.perf_counter() - begin
    tokens = sum(len(p) + len(r) for p, r in examples)
    return {**metrics, "timing_s/step": seconds, "perf/throughput": tokens / seconds / workers}


def validate(stages: Stages, shards: list[list[Example]]) -> dict[str, float]:
    """`val/sft/loss`: the mean response-token NLL over every rank's held-out examples."""
    submit = lambda method, *args: method.remote(*args)  # noqa: E731
    results = ray.get(step_graph(stages, shards, submit, "sft_eval"), timeout=stages.timeout)
    return {"val/sft/loss": sum(r["nll"] for r in results) / sum(r["tokens"] for r in results)}


def load(cfg: Config, model_path: str, files: list[str]) -> tuple[list[Example], dict[str, int]]:
    """The usable examples of `files` and skip counts; responses fit `rollout.max_new_tokens`."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return load_examples(files, tokenizer, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens,
                         cfg.data.overlong_prompts)


def sft_config(cfg: Config) -> Config:
    # one optimizer step per step (so the lr schedule spans trainer.total_steps)
    return replace(cfg, actor=replace(cfg.actor, mini_batch_prompts=cfg.data.prompts_per_step, ppo_epochs=1))


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The SFT loop; returns the exported HF directory of the final policy."""
    cfg = sft_config(cfg)
    t, workers = cfg.trainer, cfg.placement.workers
    examples, counts = load(cfg, model_path, files["train"])
    val_examples = load(cfg, model_path, files["val"])[0][:cfg.data.val_max_prompts or None]
    val_examples, counts["val_left_out"] = even_cut(val_examples, workers, "validation examples")
    val = shard(val_examples, workers)
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(examples, cfg.data.prompts_per_step, t.seed)
    stages = Stages(cfg, model_path, reference=False)
    return run(cfg, stages, step_graph, loader, tracker, lambda run_step, batch: sft_step(run_step, batch, workers),
               lambda: validate(stages, val), lambda m: f"loss {m['sft/loss']:.4f} grad_norm "
               f"{m['sft/grad_norm']:.3f} tok/s/gpu {m['perf/throughput']:.0f}")


def warm_start(cfg: Config, model_path: str, train_files: list[str], tracker: Tracker) -> str:
    """`warmstart.steps` supervised steps from `model_path` on the training rows' responses (a
    prompt row's ground truth); returns the new HF directory."""
    return supervised(cfg, model_path, load(cfg, model_path, train_files)[0], tracker)


def supervised(cfg: Config, model_path: str, examples: list[Example], tracker: Tracker) -> str:
    """`warmstart.steps` SFT steps on one worker; returns the HF directory `<output_dir>/warmstart`,
    reused when it is already there. Logs `warmstart/{loss,grad_norm,lr}` every 10 steps and prints
    the loss and the mean step time at every tenth of the run."""
    w, target = cfg.warmstart, Path(cfg.trainer.output_dir) / "warmstart"
    if (target / "config.json").is_file():
        print(f"warm-start: reusing {target}")
        return str(target)
    ws_cfg = sft_config(replace(
        cfg, actor=replace(cfg.actor, lr=w.lr, warmup_steps=0, lr_schedule="constant", sp=1),
        data=replace(cfg.data, prompts_per_step=w.batch_size), placement=replace(cfg.placement, workers=1),
        trainer=replace(cfg.trainer, total_steps=w.steps)))
    rng = random.Random(cfg.trainer.seed)  # independent draws, as the warm start always made them
    stages = Stages(ws_cfg, model_path, reference=False)
    release: Callable = lambda: None  # noqa: E731
    try:
        run_step, release = make_runner(ws_cfg, stages, step_graph)
        every, since = max(1, w.steps // 10), time.perf_counter()  # ten lines a warm start: a long one shows it moves
        for step in range(w.steps):
            metrics = sft_step(run_step, rng.sample(examples, w.batch_size), 1)
            if step % 10 == 0 or step == w.steps - 1:
                tracker.log_metrics({f"warmstart/{k[4:]}": v for k, v in metrics.items() if k.startswith("sft/")},
                                    step=step)
            if (step + 1) % every == 0:
                now = time.perf_counter()
                print(f"warm-start: step {step + 1}/{w.steps}, loss {metrics['sft/loss']:.4f}, "
                      f"{(now - since) / every:.3f} s a step", flush=True)
                since = now
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        stages.actors("export", str(tmp))
        os.replace(tmp, target)
    finally:
        release()
        stages.shutdown()
    return str(target)

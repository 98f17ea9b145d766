"""Supervised fine-tuning from prompt -> response rows to gradients, on Ray, tracked in MLflow; also
the warm start the other pipelines run before RL or DPO.

Algorithm: minimise next-token cross-entropy on the response tokens only (the prompt is context),
a mean over every response token of the step's examples. A row holds `prompt` and `response`
(eos appended); a prompt row's `reward_model.ground_truth` serves as its response, which suits
tasks whose ground truth is the whole answer (the embedded arithmetic task). Dropped: packing
several examples into one training row across prompts, loss on prompt tokens, NEFTune noise.

One step (`step_graph`), `data.prompts_per_step` examples split into equal contiguous shards:
    examples -> policy.update with the `Supervised` loss (one optimizer step, collective over the ranks)
compiled into a Ray compiled graph (`trainer.dag=compiled`) or run as `.remote()` calls (`plain`).
`actor.mini_batch_prompts` and `actor.ppo_epochs` do not apply: one step is one optimizer step.
Validation (`val/sft/loss`, the mean response-token NLL of `data.val_files`), checkpoints,
restarts and logging are the driver loop's (pipelines/driver.py), between executions.

The warm start (`supervised`) runs the same step on one worker for at most `warmstart.steps` steps
of `BATCH` examples (all of them, where fewer) at a constant `warmstart.lr`, without checkpoints. Before RL,
with `warmstart.stop_accuracy` > 0, it holds 256 training prompts out and ends
once their greedy accuracy (scored by the run's reward, measured every `CHECK_EVERY`
steps) reaches that: where a warm start lands, not how many steps it took, decides how much RL
can gain, and the steps a given accuracy takes vary with the machine's arithmetic and the seed.

Invariants:
- batches are drawn with generators seeded from `trainer.seed`: a `PromptLoader` (shuffled epochs,
  so a resumed run draws the same batches), and for the warm start independent samples;
- the warm-start directory appears only complete (written to a temp dir, then renamed), so a
  resumed run reuses it instead of training it again.

Run: `rlflow sft [RECIPE] [key=value ...]` (the recipes `sft` and `demo-sft`).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rlflow.engine.agents.env import offered_tools
from rlflow.engine.batch import Batch, Update
from rlflow.engine.config import Config, ConfigError, override
from rlflow.engine.data.prompts import Example, Prompt, PromptLoader, examples_batch, load_examples, load_prompts
from rlflow.engine.tracking import Tracker
from rlflow.engine.train.losses import Supervised
from rlflow.pipelines import driver, grpo
from rlflow.pipelines.runtime import SUBMIT, Runner, Stages, launch, rollout, wait
from rlflow.stages.policy import Policy


def step_graph(stages: Stages, inputs: list[Any], loss: Supervised) -> tuple[list[Any], list[Any]]:
    """One optimizer step: every rank's shard, together."""
    return [stages.policy.at(rank, Policy.update, shard, loss) for rank, shard in enumerate(inputs)], []


def shard(examples: list[Example], workers: int, pad_id: int) -> list[Batch]:
    """Contiguous equal shards, one Batch per rank."""
    size = len(examples) // workers
    return [examples_batch(examples[i * size:(i + 1) * size], pad_id) for i in range(workers)]


def step_metrics(outputs: list[Update], seconds: float, tokens: int, workers: int) -> dict[str, float]:
    """`sft/*` (the same on every rank after the all-reduce), the step's time and tokens/s/GPU."""
    return {**outputs[0].metrics, "timing_s/step": seconds, "perf/throughput": tokens / seconds / workers}


class SFT:
    """Supervised fine-tuning for the driver loop (pipelines/driver.py)."""

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        return step_graph(stages, inputs, self.loss)

    def __init__(self, cfg: Config, model_path: str, pad_id: int, val: list[Batch]) -> None:
        self.cfg, self.model_path, self.pad_id, self.val = cfg, model_path, pad_id, val
        self.loss = Supervised(cfg)
        self.tokens = 0  # of the step in flight, for its throughput

    def launch(self) -> Stages:
        return launch(self.cfg, self.model_path, reward=False, generates=False)

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        examples = loader.next_batch()
        self.tokens = sum(len(e.prompt) + len(e.response) for e in examples)
        return shard(examples, stages.workers, self.pad_id), {}

    def metrics(self, outputs: list[Update], seconds: float) -> dict[str, float]:
        return step_metrics(outputs, seconds, self.tokens, len(outputs))

    def samples(self, outputs: list[Any]) -> list[dict]:
        return []

    def validate(self, stages: Stages, step: int) -> dict[str, float]:
        """`val/sft/loss`: the mean response-token NLL over every rank's held-out examples."""
        policy = stages.policy.bound(SUBMIT)
        results = wait([policy.at(r, Policy.evaluate, part, self.loss) for r, part in enumerate(self.val)], SUBMIT)
        return {"val/sft/loss": results[0].metrics["sft/loss"]}  # every rank's tokens: the same on each

    def after_step(self, stages: Stages, outputs: list[Any]) -> None:
        pass

    def headline(self, m: dict[str, float], validation: bool) -> str:
        if validation:
            return f"loss {m['val/sft/loss']:.4f}"
        return f"loss {m['sft/loss']:.4f} grad_norm {m['sft/grad_norm']:.3f} tok/s/gpu {m['perf/throughput']:.0f}"


def load(cfg: Config, model_path: str, files: list[str]) -> tuple[list[Example], dict[str, int], int]:
    """The usable examples of `files`, skip counts, and the pad token id; responses fit
    `rollout.max_new_tokens` (with `rollout.env`, demonstrations fit `rollout.episode_tokens` and see
    its tools)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    r = cfg.rollout
    examples, counts = load_examples(files, tokenizer, cfg.data.max_prompt_tokens,
                                     r.episode_tokens if r.env else r.max_new_tokens, cfg.data.overlong_prompts,
                                     offered_tools(r.env))
    return examples, counts, tokenizer.pad_token_id


def sft_config(cfg: Config) -> Config:
    """One optimizer step per step, so the lr schedule spans trainer.total_steps (said where it changes a value)."""
    return override(cfg, "one SFT step is one optimizer step",
                    **{"actor.mini_batch_prompts": cfg.data.prompts_per_step, "actor.ppo_epochs": 1})


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The SFT run; returns the exported HF directory of the final policy."""
    cfg = sft_config(cfg)
    workers = cfg.placement.workers
    examples, counts, pad_id = load(cfg, model_path, files["train"])
    val_examples = load(cfg, model_path, files["val"])[0][:cfg.data.val_max_prompts or None]
    val_examples, counts["val_left_out"] = driver.even_cut(val_examples, workers, "validation examples")
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(examples, cfg.data.prompts_per_step, cfg.trainer.seed)
    return driver.run(cfg, SFT(cfg, model_path, pad_id, shard(val_examples, workers, pad_id)), loader, tracker)


def warm_start(cfg: Config, model_path: str, train_files: list[str], tracker: Tracker,
               demos: list[str] | None = None) -> str:
    """Supervised steps from `model_path` on the training rows' responses (a prompt row's ground
    truth; or the rows of `demos`) before RL, up to `warmstart.stop_accuracy` on held-out training
    prompts; returns the new HF directory."""
    examples, _, pad_id = load(cfg, model_path, demos or train_files)
    dev: list[Prompt] = []
    if cfg.warmstart.stop_accuracy:
        prompts, _ = load_prompts(train_files, AutoTokenizer.from_pretrained(model_path), cfg.data.max_prompt_tokens,
                                  cfg.data.overlong_prompts, offered_tools(cfg.rollout.env))
        examples, dev = hold_out(examples, prompts, DEV_PROMPTS, cfg.trainer.seed)
    return supervised(cfg, model_path, examples, pad_id, tracker, dev)


# examples per warm-start step, on one worker: the embedded demo's warm start, for which it was tuned with
# warmstart.lr (docs/learning.md); a model of your own starts with none, and `rlflow sft` has its own sizes
BATCH = 32
DEV_PROMPTS = 256  # training prompts the warm start holds out, to measure its accuracy on
CHECK_EVERY = 50  # warm-start steps between two measurements of that accuracy


def hold_out(examples: list[Example], prompts: list[Prompt], n: int, seed: int) -> tuple[list[Example], list[Prompt]]:
    """`n` of `prompts` drawn with `seed` (at most half of them), and `examples` without those prompts."""
    dev = random.Random(seed).sample(prompts, min(n, len(prompts) // 2))
    held = {tuple(p.ids) for p in dev}
    return [e for e in examples if tuple(e[0]) not in held], dev


def supervised(cfg: Config, model_path: str, examples: list[Example], pad_id: int, tracker: Tracker,
               dev: list[Prompt] | None = None) -> str:
    """At most `warmstart.steps` SFT steps on one worker; with `dev` prompts and
    `warmstart.stop_accuracy`, until their greedy accuracy reaches it. Returns the HF directory
    `<output_dir>/warmstart`, reused when it is already there. Logs `warmstart/{loss,grad_norm,lr}`
    every 10 steps (and `warmstart/dev_accuracy` at each measurement) and prints the loss and the
    mean step time at every tenth of the run."""
    w, target = cfg.warmstart, Path(cfg.trainer.output_dir) / "warmstart"
    if (target / "config.json").is_file():
        print(f"warm-start: reusing {target}")
        return str(target)
    size = min(BATCH, len(examples))  # a small training set: all of it each step
    if not size:
        raise ConfigError("the warm start has no examples"
                          + (f" once {len(dev)} prompts are held out to measure its accuracy" if dev else "")
                          + ": set warmstart.stop_accuracy=0 (no prompts held out) or warmstart.steps=0")
    # the warm start's own phase, from the warmstart section: the run's settings stay as they are
    ws_cfg = replace(
        cfg, actor=replace(cfg.actor, lr=w.lr, warmup_steps=0, lr_schedule="constant", sp=1,
                           mini_batch_prompts=size, ppo_epochs=1, lora_rank=0),  # full weights: LoRA's base
        data=replace(cfg.data, prompts_per_step=size), trainer=replace(cfg.trainer, total_steps=w.steps),
        placement=replace(cfg.placement, workers=1, own_pool=[]), rollout=replace(cfg.rollout, tp=1))  # one process
    rng = random.Random(cfg.trainer.seed)  # independent draws, as the warm start always made them
    dev = dev or []
    checks = bool(dev) and w.stop_accuracy > 0  # greedy answers, generated and scored as in validation
    stages = launch(ws_cfg, model_path, reward=checks, generates=checks)
    run_step: Runner | None = None
    try:
        loss = Supervised(ws_cfg)
        run_step = Runner(stages, lambda s, inputs: step_graph(s, inputs, loss), ws_cfg.trainer.dag)
        every, since = max(1, w.steps // 10), time.perf_counter()  # ten lines a warm start: a long one shows it moves
        for step in range(w.steps):
            begin = time.perf_counter()
            batch = rng.sample(examples, size)
            metrics = step_metrics(run_step([examples_batch(batch, pad_id)]), time.perf_counter() - begin,
                                   sum(len(e.prompt) + len(e.response) for e in batch), 1)
            if step % 10 == 0 or step == w.steps - 1:
                tracker.log_metrics({f"warmstart/{k[4:]}": v for k, v in metrics.items() if k.startswith("sft/")},
                                    step=step)
            if (step + 1) % every == 0:
                now = time.perf_counter()
                print(f"warm-start: step {step + 1}/{w.steps}, loss {metrics['sft/loss']:.4f}, "
                      f"{(now - since) / every:.3f} s a step", flush=True)
                since = now
            if checks and ((step + 1) % CHECK_EVERY == 0 or step == w.steps - 1):
                accuracy = dev_accuracy(stages, dev, step)
                tracker.log_metrics({"warmstart/dev_accuracy": accuracy}, step=step)
                if accuracy >= w.stop_accuracy:
                    print(f"warm-start: greedy accuracy {accuracy:.3f} on {len(dev)} training prompts held out of "
                          f"it reached warmstart.stop_accuracy={w.stop_accuracy:g} at step {step + 1}", flush=True)
                    break
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        stages.policy.all(Policy.export, str(tmp))
        os.replace(tmp, target)
    finally:
        if run_step is not None:
            run_step.close()
        stages.shutdown()
    return str(target)


def dev_accuracy(stages: Stages, prompts: list[Prompt], step: int) -> float:
    """The fraction of `prompts` whose greedy answer scores >= 1, as validation's `accuracy`."""
    greedy = rollout(stages.generator, stages.reward, prompts, step, greedy=True)
    return grpo.summarise("", [s for b in greedy for s in b.data_source], [float(x) for b in greedy for x in b.scores],
                          [])["accuracy"]

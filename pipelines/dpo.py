"""DPO from preference pairs to gradients, on Ray, tracked in MLflow.

Algorithm (Rafailov et al., 2023): for a prompt x with a chosen answer c and a rejected one r,
minimise -log sigmoid(beta * ((log pi(c|x) - log ref(c|x)) - (log pi(r|x) - log ref(r|x)))),
log-probabilities summed over each answer's tokens, `ref` the frozen starting policy. The implicit
reward of an answer is beta * (log pi - log ref); its chosen-minus-rejected margin and how often it
is positive (`reward_accuracy`) are what the run tracks, on the training pairs (`dpo/*`, measured
in the step's forward, before that mini-batch's update) and on held-out pairs (`val/*`).
`dpo.nll_coef` adds the chosen answers' mean token NLL to the loss (RPO, Pang et al., 2024).
Dropped: label smoothing / IPO / conservative variants, and precomputed reference logprobs (the
reference recomputes them each step, next to the actor, as in GRPO's KL path).

One step, per data-parallel rank (`step_graph`):
    pairs -> reference.logprobs -> policy.update with the `Preference` loss
compiled into a Ray compiled graph (`trainer.dag=compiled`) or run as `.remote()` calls (`plain`).
Validation, checkpoints, restarts and logging are the driver loop's (pipelines/driver.py),
between executions. With the embedded
model, the warm start is supervised training on the training pairs' chosen answers (on the
embedded pairs, the GRPO default's warm-start examples, in the same order), ending, as before
RL, once greedy answers to 256 held-out pairs' prompts match their chosen answers often enough.

Invariants:
- a pair's two rows (chosen, then rejected: group_size 2) stay on one rank and in one micro-batch;
- metrics are means over the pairs of every rank (the loss all-reduces its sums);
- a resumed run continues from the checkpoint's weights, optimizer and loader position.

Run: `rlflow dpo [RECIPE] [key=value ...]` (the recipes `dpo` and `demo-dpo`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rlflow.engine.batch import Batch, Update
from rlflow.engine.config import Config, override
from rlflow.engine.data.prompts import Example, Pair, Prompt, PromptLoader, load_pairs, pairs_batch
from rlflow.engine.tracking import Tracker
from rlflow.engine.train.losses import Preference
from rlflow.pipelines import driver
from rlflow.pipelines.runtime import SUBMIT, Stages, launch, wait
from rlflow.pipelines.sft import DEV_PROMPTS, hold_out, supervised
from rlflow.stages.policy import Policy
from rlflow.stages.reference import Reference


def step_graph(stages: Stages, inputs: list[Any], loss: Preference, held_out: bool = False) -> tuple[list[Any],
                                                                                                   list[Any]]:
    """One chain per rank: the DPO loss's optimizer steps, or with `held_out` its value without a step."""
    outputs = []
    for rank, batch in enumerate(inputs):
        if stages.reference is not None:  # else LoRA: the policy's base, adapters off, is the anchor
            batch = stages.reference.at(rank, Reference.logprobs, batch)  # the frozen anchor
        if held_out:
            outputs.append(stages.policy.at(rank, Policy.evaluate, batch, loss))
        else:
            outputs.append(stages.policy.at(rank, Policy.update, batch, loss))
    return outputs, []


def shard(pairs: list[Pair], workers: int, pad_id: int) -> list[Batch]:
    """Contiguous equal shards of whole pairs, one Batch per rank."""
    size = len(pairs) // workers
    return [pairs_batch(pairs[i * size:(i + 1) * size], pad_id) for i in range(workers)]


def merge(results: list[Update]) -> dict[str, float]:
    """The `dpo/*` means over every rank's pairs (the same on every rank) and timings (the slowest rank)."""
    return {**results[0].metrics, **{f"timing_s/{k}": max(r.timing[k] for r in results) for k in results[0].timing}}


class DPO:
    """DPO for the driver loop (pipelines/driver.py)."""

    def graph(self, stages: Stages, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        return step_graph(stages, inputs, self.loss)

    def __init__(self, cfg: Config, model_path: str, pad_id: int, val: list[Batch]) -> None:
        self.cfg, self.model_path, self.pad_id, self.val = cfg, model_path, pad_id, val
        self.loss = Preference(cfg)

    def launch(self) -> Stages:
        return launch(self.cfg, self.model_path, reward=False, reference=True, generates=False)

    def inputs(self, stages: Stages, loader: PromptLoader, step: int) -> tuple[list[Any], dict[str, float]]:
        return shard(loader.next_batch(), stages.workers, self.pad_id), {}

    def metrics(self, outputs: list[Update], seconds: float) -> dict[str, float]:
        return {**merge(outputs), "timing_s/step": seconds}

    def samples(self, outputs: list[Any]) -> list[dict]:
        return []

    def validate(self, stages: Stages, step: int) -> dict[str, float]:
        """`val/loss`, `val/reward_margin`, `val/reward_accuracy`, `val/chosen_reward`, `val/rejected_reward`."""
        outputs, _ = step_graph(stages.bound(SUBMIT), self.val, self.loss, held_out=True)
        results = wait(outputs, SUBMIT)
        return {f"val/{k[4:]}": v for k, v in results[0].metrics.items() if k.startswith("dpo/")}

    def after_step(self, stages: Stages, outputs: list[Any]) -> None:
        pass

    def headline(self, m: dict[str, float], validation: bool) -> str:
        p = "val" if validation else "dpo"
        return f"loss {m[f'{p}/loss']:.4f} margin {m[f'{p}/reward_margin']:.4f} " \
               f"accuracy {m[f'{p}/reward_accuracy']:.3f}"


def load(cfg: Config, model_path: str, files: list[str]) -> tuple[list[Pair], dict[str, int], int]:
    """The usable pairs of `files`, skip counts, and the pad token id."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs, counts = load_pairs(files, tokenizer, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens,
                               cfg.data.overlong_prompts)
    return pairs, counts, tokenizer.pad_token_id


def warm_start(cfg: Config, model_path: str, train_files: list[str], tracker: Tracker) -> str:
    """At most `warmstart.steps` supervised steps on the training pairs' chosen answers; with
    `warmstart.stop_accuracy`, until greedy answers to held-out training pairs' prompts score that
    accuracy against their chosen answers (the run's reward function scores them, as before RL).
    Returns the HF directory."""
    pairs, _, pad_id = load(cfg, model_path, train_files)
    examples, dev = [Example(p.prompt, p.chosen) for p in pairs], list[Prompt]()
    if cfg.warmstart.stop_accuracy:
        prompts = chosen_as_truth(pairs, AutoTokenizer.from_pretrained(model_path))
        examples, dev = hold_out(examples, prompts, DEV_PROMPTS, cfg.trainer.seed)
    return supervised(cfg, model_path, examples, pad_id, tracker, dev)


def chosen_as_truth(pairs: list[Pair], tokenizer: Any) -> list[Prompt]:
    """Each pair's prompt with its chosen answer's text as the ground truth, to score greedy answers against."""
    return [Prompt(p.prompt, p.data_source, str(tokenizer.decode(p.chosen, skip_special_tokens=True)), None, p.text)
            for p in pairs]


def train(cfg: Config, model_path: str, files: dict[str, list[str]], tracker: Tracker) -> Path:
    """The DPO run; returns the exported HF directory of the final policy."""
    workers = cfg.placement.workers
    cfg = override(cfg, "DPO compares the models' own distributions", **{"rollout.temperature": 1.0})
    train_pairs, counts, pad_id = load(cfg, model_path, files["train"])
    val_pairs, _, _ = load(cfg, model_path, files["val"])
    val_pairs = val_pairs[:cfg.data.val_max_prompts or None]
    val_pairs, counts["val_left_out"] = driver.even_cut(val_pairs, workers, "validation pairs")
    tracker.log_metrics({f"data/{k}": v for k, v in counts.items()}, step=0)
    loader = PromptLoader(train_pairs, cfg.data.prompts_per_step, cfg.trainer.seed)
    return driver.run(cfg, DPO(cfg, model_path, pad_id, shard(val_pairs, workers, pad_id)), loader, tracker)

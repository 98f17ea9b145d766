"""The split rollout stage generating ahead of training, in-process: weights pushed while it
generates land between engine steps (partial rollouts), and the Batch books each token's version."""

import torch
from conftest import perturbed
from transformers import AutoModelForCausalLM

from rlflow.engine.batch import RolloutRequest
from rlflow.engine.config import load_config
from rlflow.engine.data.prompts import load_prompts
from rlflow.stages.policy import staleness_metrics
from rlflow.stages.rollout import Rollout


def test_a_push_landing_mid_generation_is_taken_between_steps_and_booked_per_token(model_dir, data_files):
    cfg = load_config(None, ["trainer.max_staleness=2", "placement.own_pool=[rollout]", "rollout.backend=native",
                             "data.prompts_per_step=4", "actor.mini_batch_prompts=4", "rollout.samples_per_prompt=2",
                             "rollout.max_new_tokens=12", "data.max_prompt_tokens=16"])
    rollout = Rollout(cfg, str(model_dir))
    prompts, _ = load_prompts([data_files["train"]], rollout.tokenizer, 16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine_swap, steps = rollout.engine.swap, []

    def push_at_step_5() -> int:  # what a push received beside generation does: stage version 1
        steps.append(1)
        if len(steps) == 5:
            rollout.staged = (1, perturbed(hf))
        return engine_swap()

    rollout.engine.swap = push_at_step_5
    batch = rollout.generate(RolloutRequest(prompts[:4], step=3))
    assert rollout.weight_version == 1 and rollout.staged is None, "the push was taken mid-generation"
    versions, mask = batch.rollout_versions, batch.loss_mask > 0
    assert versions.shape == batch.response_ids.shape
    assert set(versions[mask].tolist()) == {0, 1} and batch.weight_version == 0  # the oldest token's
    rows = [versions[i][mask[i]].tolist() for i in range(len(batch))]
    assert all(r == sorted(r) for r in rows), "a sequence's versions never go back"
    spanning = [r for r in rows if r[0] == 0 and r[-1] == 1]
    assert spanning, rows
    metrics = staleness_metrics(batch, 2)  # trained by version 2
    tokens = versions[mask]
    assert metrics["async/staleness/mean"] == float((2 - tokens).float().mean())
    assert metrics["async/partial_rows"] == len(spanning) / len(batch)
    assert rollout.generate(RolloutRequest(prompts[4:8], step=4)).rollout_versions.unique().tolist() == [1]

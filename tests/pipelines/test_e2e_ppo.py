"""End-to-end PPO: the demo-ppo recipe through the real CLI on a real local Ray cluster, tracked in sqlite MLflow.

One compiled-graph run of 2 steps (the first trains only the critic), then the same run resumed
from its step-1 checkpoint in plain mode: its step 2 must repeat the first run's exactly, which
holds only if the critic's weights and optimizer state travel with the checkpoint. And one step
with the critic in its own pool of two data-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import NOISY, history, only_run, rlflow

pytestmark = pytest.mark.slow
TINY = ("data.prompts_per_step=8", "data.val_max_prompts=8", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=4", "actor.mini_batch_prompts=4", "warmstart.steps=3",
        "trainer.total_steps=2", "critic.warmup_steps=1", "trainer.val_every=0", "trainer.val_samples=0",
        "trainer.save_every=1")
CRITIC = ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean", "critic/grad_norm",
          "critic/lr", "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic")


def backbone_changed(start: dict[str, torch.Tensor], critic: dict[str, torch.Tensor]) -> bool:
    """Whether any backbone weight (`model.*`, shared by the policy and the critic) differs."""
    shared = [k for k in critic if k.startswith("model.")]
    assert shared and all(k in start for k in shared)
    return any(not torch.equal(start[k], critic[k]) for k in shared)


def test_ppo_trains_critic_then_actor_and_resumes_in_plain_mode(tmp_path: Path):
    rlflow(tmp_path, "out", *TINY, conf="demo-ppo")
    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["algorithm.advantage"] == "gae"
    metrics = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in (*CRITIC, "critic/score/mean", "actor/consecutive_skipped_steps"):
        assert list(metrics[key]) == [1, 2], key
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert list(metrics[key]) == [2], key  # step 1 is the critic's warm-up
    out = tmp_path / "out"
    start = load_file(out / "warmstart" / "model.safetensors")
    ckpt = out / "checkpoints"
    assert backbone_changed(start, load_file(ckpt / "step_000001" / "critic.safetensors"))
    policy_1 = load_file(ckpt / "step_000001" / "model.safetensors")
    assert all(torch.equal(policy_1[k], v) for k, v in start.items()), "the policy waits while the critic warms up"
    final = load_file(out / "hf_model" / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in start), "the policy moved at step 2"
    critic_1, critic_2 = (load_file(ckpt / f"step_00000{s}" / "critic.safetensors") for s in (1, 2))
    assert any(not torch.equal(critic_1[k], critic_2[k]) for k in critic_1)

    resumed = rlflow(tmp_path, "out", *TINY, f"trainer.resume={ckpt / 'step_000001'}", "trainer.dag=plain",
                     conf="demo-ppo")
    assert "at step 1" in resumed.stdout
    replayed = load_file(out / "hf_model" / "model.safetensors")
    assert all(torch.equal(final[k], replayed[k]) for k in final), "step 2 replayed exactly, in plain mode"
    client, run = only_run(tmp_path)  # the resumed job logs into the run of its checkpoint
    again = {k: v for k, v in history(client, run.info.run_id).items()
             if not k.startswith((*NOISY, "warmstart/"))}  # the warm-start's step 2 is one of its own
    for key, points in again.items():  # one value a step: the replay's own points are skipped, and said so
        assert len([step for step, _ in points if step == 2]) <= 1, (key, points)
    assert "already has steps 2 to 2, logged before the run was interrupted" in resumed.stderr


def test_critic_in_its_own_pool_over_two_ranks(tmp_path: Path):
    # two data-parallel ranks (gloo) in each pool; the critic's gradients all-reduce in its own group
    rlflow(tmp_path, "out", *TINY, "trainer.total_steps=1", "critic.warmup_steps=0", "placement.workers=2",
           "placement.own_pool=[critic]", conf="demo-ppo")
    client, run = only_run(tmp_path)
    metrics = {k: dict(v) for k, v in history(client, run.info.run_id).items()}
    for key in (*CRITIC, "actor/pg_loss"):
        assert list(metrics[key]) == [1], key
    out = tmp_path / "out"
    assert backbone_changed(load_file(out / "warmstart" / "model.safetensors"),
                            load_file(out / "checkpoints" / "step_000001" / "critic.safetensors"))

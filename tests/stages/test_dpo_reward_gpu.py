"""DPO's verbs and the reward model on a GPU: the same numbers as on the CPU, up to bf16 rounding."""

import math

import pytest
import torch
from test_policy import dpo_batch

from rlflow.engine.config import load_config
from rlflow.engine.data.reward_model import RewardModel
from rlflow.engine.train.losses import Preference
from rlflow.stages.policy import Policy
from rlflow.stages.reference import Reference

pytestmark = pytest.mark.gpu


def test_dpo_update_on_gpu_in_bf16(model_dir):
    cfg = load_config(None, ["model.dtype=bfloat16", "rollout.dtype=bfloat16", "data.prompts_per_step=8",
                             "actor.mini_batch_prompts=8", "actor.lr=1e-2"])
    actor, ref = Policy(cfg, str(model_dir), device="cuda"), Reference(cfg, str(model_dir), device="cuda")
    batch = dpo_batch(actor, ref, 8)
    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    loss = Preference(cfg)
    start = actor.evaluate(batch.rows(slice(None)), loss).metrics
    assert start["dpo/loss"] == pytest.approx(math.log(2), abs=1e-3)  # policy == reference, bf16 kernels alike
    out = actor.update(batch, loss).metrics
    assert math.isfinite(out["dpo/loss"]) and out["dpo/grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in actor.engine.model.state_dict().items())
    after = actor.evaluate(batch, loss).metrics
    assert after["dpo/reward_margin"] > start["dpo/reward_margin"]  # one step on these pairs widens their margin


def test_reward_model_on_gpu_matches_the_cpu(reward_model_dir):
    texts = ["12+30=42", "7+8=16", "99+1=100 and more text", "5+5="]
    cpu = RewardModel(str(reward_model_dir)).score(texts)
    gpu = RewardModel(str(reward_model_dir), device="cuda").score(texts)
    assert gpu.device.type == "cpu"
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4)

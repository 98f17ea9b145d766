"""The stage verbs on a GPU in bf16: rollout and trainer agree, and an update moves the weights."""

import pytest
import torch

from rlflow.engine.batch import RolloutRequest
from rlflow.engine.config import load_config
from rlflow.engine.data.prompts import load_prompts
from rlflow.engine.train.losses import PolicyGradient
from rlflow.stages.advantage import Advantage
from rlflow.stages.hybrid import HybridPolicy
from rlflow.stages.reward import Reward

pytestmark = pytest.mark.gpu

ODD_LENGTH = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def test_grpo_step_on_gpu_in_bf16(model_dir, data_files, tmp_path):
    (tmp_path / "odd.py").write_text(ODD_LENGTH)
    cfg = load_config(None, [f"reward.function={tmp_path}/odd.py:compute_score", "model.dtype=bfloat16",
                             "rollout.dtype=bfloat16", "data.prompts_per_step=16", "rollout.samples_per_prompt=4"])
    actor, reward = HybridPolicy(cfg, str(model_dir), device="cuda"), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 64)
    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    batch = actor.logprobs(reward.score(actor.generate(RolloutRequest(prompts[:16], step=0))))
    out = actor.update(Advantage(cfg).estimate(batch), PolicyGradient(cfg))
    m = out.metrics
    # on-policy, the update's forward measures it: bf16 generate and bf16 training forward differ
    # only by kernel rounding
    assert m["training/rollout_probs_diff_mean"] < 0.02
    assert m["actor/grad_norm"] > 0
    assert {f"perf/max_memory_allocated_gb/{p}" for p in ("gen", "update_actor")} <= set(m)
    assert any(not torch.equal(v, before[k]) for k, v in actor.engine.model.state_dict().items())


def test_lora_grpo_steps_on_gpu_keep_a_bf16_base_and_generate_with_the_adapters(model_dir, data_files, tmp_path):
    (tmp_path / "odd.py").write_text(ODD_LENGTH)
    cfg = load_config(None, [f"reward.function={tmp_path}/odd.py:compute_score", "model.dtype=bfloat16",
                             "rollout.dtype=bfloat16", "data.prompts_per_step=16", "rollout.samples_per_prompt=4",
                             "actor.lora_rank=8", "actor.lr=5e-2", "actor.kl_loss_coef=0.1"])
    actor, reward = HybridPolicy(cfg, str(model_dir), device="cuda"), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 64)
    params = dict(actor.engine.model.named_parameters())
    base = {k: p.detach().clone() for k, p in params.items() if not p.requires_grad}
    assert {p.dtype for p in base.values()} == {torch.bfloat16}, "a frozen base needs no fp32 master copy"
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    for step in range(3):
        batch = actor.logprobs(reward.score(actor.generate(RolloutRequest(prompts[:16], step=step))))
        m = actor.update(Advantage(cfg).estimate(batch), PolicyGradient(cfg)).metrics
        assert m["training/rollout_probs_diff_mean"] < 0.02, step  # the engine holds the merged weights
        assert m["actor/kl_loss"] >= 0
    assert m["actor/kl_loss"] > 0, "the adapted policy moved away from its base"
    for k, v in base.items():
        assert torch.equal(params[k].detach(), v), k

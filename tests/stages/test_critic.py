"""The critic stage in-process: value alignment, a learning update, a checkpoint round trip, and GAE
advantages through the advantage stage."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from rlflow.engine import algos
from rlflow.engine.batch import Batch, RolloutRequest
from rlflow.engine.config import load_config
from rlflow.engine.data.prompts import load_prompts
from rlflow.engine.tensors import left_pad, right_pad
from rlflow.engine.train.losses import PolicyGradient
from rlflow.stages.advantage import Advantage
from rlflow.stages.critic import Critic
from rlflow.stages.hybrid import HybridPolicy
from rlflow.stages.reward import Reward

PPO = ["algorithm.name=ppo", "algorithm.advantage=gae", "data.max_prompt_tokens=16", "rollout.max_new_tokens=6",
       "data.prompts_per_step=4", "actor.mini_batch_prompts=2", "rollout.samples_per_prompt=2"]


def fixed_batch(tokenizer, data_files: dict[str, str]) -> Batch:
    """8 real prompts (4 groups of 2) with random responses of ragged lengths, each returning its row's score."""
    prompts, _ = load_prompts([data_files["train"]], tokenizer, 16)
    pids, pmask = left_pad([p.ids for p in prompts[:8]], tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 3, 6, 2, 5, 4]
    responses = [torch.randint(3, 20, (n,), generator=g).tolist() for n in lengths]
    batch = Batch(pids, pmask, 2, ["arith"] * 8, ["0"] * 8, [None] * 8,
                  response_ids=right_pad(responses, tokenizer.pad_token_id, torch.long),
                  response_mask=right_pad([[1.0] * n for n in lengths], 0.0, torch.float32))
    batch.returns = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 0])[:, None] * batch.response_mask  # [8, 6], gamma = lam = 1
    return batch


def test_values_are_the_head_at_the_positions_that_predict_response_tokens(model_dir, data_files):
    cfg = load_config(None, PPO + ["actor.micro_batch_tokens_per_gpu=44"])  # 2 rows of 22 tokens per forward
    critic = Critic(cfg, str(model_dir))
    batch = critic.values(fixed_batch(AutoTokenizer.from_pretrained(model_dir), data_files))
    assert batch.values.shape == batch.response_ids.shape == (8, 6)
    assert torch.all(batch.values[batch.response_mask == 0] == 0)

    # transformers' own forward of the same weights, in eval mode: logits [N, P+R, 1]
    direct = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).eval()
    direct.load_state_dict(critic.engine.full_state_dict())
    ids, mask, pos = batch.sequences()
    with torch.no_grad():
        logits = direct(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]
    P = batch.prompt_ids.shape[1]
    want = logits[:, P - 1:P - 1 + 6] * batch.response_mask  # column P-1+t sees the prompt and response[:t]
    torch.testing.assert_close(batch.values, want, rtol=1e-5, atol=1e-6)
    # the head is fresh but the backbone is the policy's: the values differ from token to token
    assert batch.values[batch.response_mask.bool()].std() > 0


def test_update_fits_the_returns_and_the_checkpoint_restores_it(model_dir, data_files, tmp_path):
    cfg = load_config(None, PPO + ["critic.lr=1e-3", "critic.cliprange_value=10", "actor.ppo_epochs=4"])
    critic = Critic(cfg, str(model_dir))
    batch = critic.values(fixed_batch(AutoTokenizer.from_pretrained(model_dir), data_files))
    before = {k: v.clone() for k, v in critic.engine.model.state_dict().items()}
    loss_before, _ = algos.value_loss(batch.values, batch.values, batch.returns, batch.response_mask, 10.0)

    batch = critic.update(batch)
    m = batch.metrics
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/grad_norm", "critic/lr",
                "critic/vf_explained_var", "critic/returns/mean"):
        assert key in m and m[key] == m[key], key
    assert m["critic/lr"] == 1e-3 and "update_critic" in batch.timing
    assert m["critic/vf_explained_var"] == pytest.approx(float(
        algos.explained_variance(batch.values, batch.returns, batch.response_mask)))
    assert all(not torch.equal(v, before[k]) for k, v in critic.engine.model.state_dict().items()), \
        "every critic weight, the backbone's included, gets a gradient"
    after = critic.values(Batch(**{**vars(batch), "metrics": {}, "timing": {}}))
    loss_after, _ = algos.value_loss(after.values, after.values, after.returns, after.response_mask, 10.0)
    assert float(loss_after) < 0.25 * float(loss_before)  # 8 optimizer steps on one fixed batch

    critic.save(str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {"critic.safetensors", "critic_trainer"}
    fresh = Critic(cfg, str(model_dir))
    fresh.load(str(tmp_path))
    again = fresh.values(Batch(**{**vars(batch), "metrics": {}, "timing": {}}))
    assert torch.equal(again.values, after.values)
    assert fresh.engine.scheduler.state_dict() == critic.engine.scheduler.state_dict()
    # the optimizer moments came back too: one more step from either lands on the same weights
    critic.update(after), fresh.update(again)
    for k, v in critic.engine.model.state_dict().items():
        assert torch.equal(v, fresh.engine.model.state_dict()[k]), k


def test_one_mini_batch_of_many_micro_batches_equals_one_micro_batch(model_dir, data_files):
    updates = []
    for budget in (22, 4096):  # one row per micro-batch, or the whole mini-batch in one
        cfg = load_config(None, PPO + [f"actor.micro_batch_tokens_per_gpu={budget}", "actor.mini_batch_prompts=4"])
        critic = Critic(cfg, str(model_dir))
        start = {k: v.clone() for k, v in critic.engine.model.state_dict().items()}
        batch = critic.update(critic.values(fixed_batch(AutoTokenizer.from_pretrained(model_dir), data_files)))
        grads = {k: p.grad for k, p in critic.engine.model.named_parameters()}  # the one optimizer step's
        updates.append((start, batch.metrics, grads))
    (s1, m1, g1), (s2, m2, g2) = updates
    assert all(torch.equal(s1[k], s2[k]) for k in s1), "the fresh value head is seeded: replicas start equal"
    assert m1["critic/vf_loss"] == pytest.approx(m2["critic/vf_loss"], rel=1e-5)
    assert m1["critic/grad_norm"] == pytest.approx(m2["critic/grad_norm"], rel=1e-4)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-7, msg=k)


LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def test_gae_advantages_are_whitened_and_returns_are_the_critics_targets(model_dir, data_files, tmp_path):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    cfg = load_config(None, PPO + [f"reward.function={tmp_path}/length_reward.py:compute_score", "algorithm.lam=0.9",
                                   "critic.warmup_steps=1", "trainer.total_steps=2"])
    actor, critic, reward = HybridPolicy(cfg, str(model_dir)), Critic(cfg, str(model_dir)), Reward(cfg)
    adv, loss = Advantage(cfg), PolicyGradient(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    batch = critic.values(actor.logprobs(reward.score(actor.generate(RolloutRequest(prompts[:4], step=0)))))
    batch = adv.estimate(batch)
    mask = batch.response_mask
    raw, returns = algos.gae(algos.on_last_token(batch.scores, mask), batch.values, mask, 1.0, 0.9)
    torch.testing.assert_close(batch.returns, returns)
    torch.testing.assert_close(batch.advantages, algos.masked_whiten(raw, mask))
    valid = batch.advantages[mask.bool()]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(valid.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)

    # step 0 < critic.warmup_steps: the critic learns, the policy does not move
    policy = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    out = actor.update(critic.update(batch), loss)
    assert "critic/vf_loss" in out.metrics and "actor/pg_loss" not in out.metrics
    assert all(torch.equal(v, policy[k]) for k, v in actor.engine.model.state_dict().items())
    assert out.weight_version == 0  # no step: the rollout engine's weights stay current
    batch = adv.estimate(critic.values(actor.logprobs(reward.score(actor.generate(
        RolloutRequest(prompts[:4], step=1))))))
    out = actor.update(critic.update(batch), loss)
    assert "actor/pg_loss" in out.metrics and out.weight_version == 1
    assert any(not torch.equal(v, policy[k]) for k, v in actor.engine.model.state_dict().items())


def test_the_fresh_heads_load_report_is_dropped_and_any_other_kept(model_dir, tmp_path, caplog):
    """transformers warns with a table of the keys a load missed: the critic's head, absent from the
    policy's directory by design, goes unreported; a key missing from the backbone still shows."""
    from safetensors.torch import load_file, save_file

    from rlflow.stages.critic import fresh_head_unreported

    def reports() -> list[str]:
        return [r.getMessage() for r in caplog.records if "LOAD REPORT" in r.getMessage()]

    with caplog.at_level("WARNING", logger="transformers.modeling_utils"):
        AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1)
        assert len(reports()) == 1 and "score.weight" in reports()[0]  # what a user saw on every PPO start
        caplog.clear()
        with fresh_head_unreported():
            AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1)
        assert reports() == []
        broken = tmp_path / "broken"
        shutil.copytree(model_dir, broken)
        weights = load_file(broken / "model.safetensors")
        save_file({k: v for k, v in weights.items() if "layers.0.mlp.up_proj" not in k}, broken / "model.safetensors",
                  metadata={"format": "pt"})
        with fresh_head_unreported():
            AutoModelForTokenClassification.from_pretrained(broken, num_labels=1)
        assert len(reports()) == 1 and "up_proj" in reports()[0]

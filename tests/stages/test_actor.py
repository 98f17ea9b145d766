"""The stage verbs in-process, in the order the pipeline runs them."""

import math

import pytest
import torch

from engine.batch import RolloutRequest
from engine.config import load_config
from engine.data import load_prompts
from engine.train import response_logprobs
from stages.actor import ActorRollout
from stages.reference import Reference
from stages.reward import Reward

LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_one_grpo_step_through_the_verbs(model_dir, data_files, tmp_path, backend):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # a random policy scores 0 on arithmetic
    cfg = load_config(None, [f"reward.function={tmp_path}/length_reward.py:compute_score", f"rollout.backend={backend}",
                             "data.prompts_per_step=8", "actor.mini_batch_prompts=4", "rollout.samples_per_prompt=4",
                             "actor.kl_loss_coef=0.01", "actor.lr=1e-2", "actor.micro_batch_tokens_per_gpu=64",
                             "data.max_prompt_tokens=16"])
    actor, ref, reward = ActorRollout(cfg, str(model_dir)), Reference(cfg, str(model_dir)), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 64)
    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}

    batch = actor.generate(RolloutRequest(prompts[:8], step=0))
    assert len(batch) == 32 and batch.group_size == 4
    assert batch.prompt_text[0] == batch.prompt_text[3] != batch.prompt_text[4]
    batch = reward.score(batch)
    batch = ref.logprobs(batch)
    batch = actor.logprobs(batch)
    # same weights everywhere before the update: reference, trainer and rollout agree
    torch.testing.assert_close(batch.ref_logprobs, batch.old_logprobs)
    assert batch.metrics["training/rollout_probs_diff_max"] < 1e-4
    batch = actor.advantages(batch)
    assert torch.all(batch.advantages[batch.response_mask == 0] == 0)
    out = actor.update(batch)

    m = out["metrics"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "actor/kl_loss", "critic/score/mean", "response_length/mean", "prompt_length/mean"):
        assert key in m and m[key] == m[key], key
    assert set(out["timing"]) == {"gen", "reward", "ref", "old_log_prob", "adv", "update_actor"}
    assert out["samples"][0]["prompt"].endswith("=")
    changed = [k for k, v in actor.engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the update must change the policy"
    # the rollout engine samples from the updated weights: its logprobs match the trainer's again
    batch = actor.logprobs(actor.generate(RolloutRequest(prompts[:8], step=1)))
    assert batch.metrics["training/rollout_probs_diff_max"] < 1e-4

    # a checkpoint round-trips the weights and optimizer into a fresh actor
    (tmp_path / "ckpt").mkdir()
    actor.save(str(tmp_path / "ckpt"))
    import random

    import numpy as np

    states = (random.random(), np.random.rand(), torch.rand(1))  # what the next draws would be
    fresh = ActorRollout(cfg, str(model_dir))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # scramble, then restore from the checkpoint
    fresh.load(str(tmp_path / "ckpt"))
    assert (random.random(), np.random.rand(), torch.rand(1)) == states
    for k, v in actor.engine.model.state_dict().items():
        assert torch.equal(v, fresh.engine.model.state_dict()[k]), k
    assert fresh.engine.scheduler.state_dict() == actor.engine.scheduler.state_dict()


def test_remax_baseline_is_the_scored_greedy_answer(model_dir, data_files, tmp_path):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    cfg = load_config(None, [f"reward.function={tmp_path}/length_reward.py:compute_score", "algorithm.advantage=remax",
                             "rollout.samples_per_prompt=2", "data.max_prompt_tokens=16"])
    actor, reward = ActorRollout(cfg, str(model_dir)), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    batch = actor.advantages(reward.score(actor.generate(RolloutRequest(prompts[:4], step=0))))
    greedy = actor.generate(RolloutRequest(prompts[:4], step=0, greedy=True))
    assert batch.baseline_responses == [r for r in greedy.responses for _ in range(2)]
    expected = [float(len(r) % 2) for r in batch.baseline_responses]
    assert batch.baseline_scores.tolist() == expected
    torch.testing.assert_close(batch.advantages, (batch.scores - batch.baseline_scores)[:, None] * batch.response_mask)
    assert greedy.baseline_responses == []  # validation requests carry no baseline


def test_sft_update_lowers_the_loss(model_dir):
    cfg = load_config(None, [])
    actor = ActorRollout(cfg, str(model_dir))
    tok = actor.tokenizer
    pairs = [(tok.encode(f"{a}+{a}="), tok.encode(str(2 * a)) + [tok.eos_token_id]) for a in range(16)]
    evals, losses = [], []
    for _ in range(20):
        ev = actor.sft_eval(pairs)
        evals.append(ev["nll"] / ev["tokens"])
        losses.append(actor.sft_update(pairs)["sft/loss"])
    assert losses[-1] < losses[0] * 0.7
    assert ev["tokens"] == sum(len(r) for _, r in pairs)
    # the held-out loss is the training loss of the same weights, without the step
    assert evals == pytest.approx(losses, rel=1e-5)


def test_export_loads_with_transformers(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = ActorRollout(load_config(None, []), str(model_dir))
    actor.export(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").decode([5, 6]) == actor.tokenizer.decode([5, 6])
    for k, v in actor.engine.full_state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_update_does_not_depend_on_packing_or_micro_batching(model_dir, data_files, tmp_path, loss_agg):
    """One optimizer step over 8 prompts x 2 samples: packed or padded, in one micro-batch or many,
    with old logprobs from the update's own forward (on-policy) or recomputed, the loss and gradient
    agree."""
    from dataclasses import replace

    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    cfg = load_config(None, [f"reward.function={tmp_path}/length_reward.py:compute_score", "data.prompts_per_step=8",
                             "actor.mini_batch_prompts=8", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
                             "data.max_prompt_tokens=16", f"actor.loss_agg={loss_agg}", "actor.entropy_coef=0.01",
                             "actor.grad_clip=1e9", "actor.micro_batch_tokens_per_gpu=1024"])
    actor, reward = ActorRollout(cfg, str(model_dir)), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 64)
    batch = actor.advantages(actor.logprobs(reward.score(actor.generate(RolloutRequest(prompts[:8], step=0)))))
    assert batch.old_logprobs.numel() == 0, "one epoch of one mini-batch is on-policy: the update's forward gives them"
    assert len(set(batch.response_mask.sum(1).tolist())) > 1, "the equivalence needs mixed lengths"
    start = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    results = []
    for pack, budget in [(False, 1024), (True, 1024), (True, 28), (False, 28)]:  # 28: one row per padded micro-batch
        actor.cfg = replace(cfg, actor=replace(cfg.actor, pack_sequences=pack, micro_batch_tokens_per_gpu=budget))
        actor.engine.model.load_state_dict(start)
        m = actor.update(batch.rows(slice(None)))["metrics"]
        results.append((m["actor/pg_loss"], m["training/rollout_probs_diff_max"],
                        [p.grad.clone() for p in actor.engine.model.parameters()]))
    # recomputed old logprobs (what a second epoch or mini-batch would use) give the same update
    actor.engine.model.load_state_dict(start)
    recomputed = batch.rows(slice(None))
    recomputed.old_logprobs, _ = response_logprobs(actor.engine.root, *recomputed.sequences(), recomputed.response_ids,
                                                   cfg.rollout.temperature, 1024)
    m = actor.update(recomputed)["metrics"]
    results.append((m["actor/pg_loss"], results[0][1], [p.grad.clone() for p in actor.engine.model.parameters()]))
    for loss, mismatch, grads in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-8)
        assert mismatch == pytest.approx(results[0][1], rel=1e-3, abs=1e-7)
        for (name, _), a, b in zip(actor.engine.model.named_parameters(), grads, results[0][2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
    assert results[0][1] < 1e-4  # trainer and rollout agree (fp32)


def dpo_batch(actor, ref, n: int):
    """n embedded-style pairs with answers of different lengths, carrying reference logprobs."""
    from engine import task
    from engine.data import Pair, pairs_batch

    tok, eos, rng = actor.tokenizer, actor.tokenizer.eos_token_id, __import__("random").Random(0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pairs = [Pair(enc(f"{a}+{a + 7}="), enc(str(2 * a + 7)) + [eos], enc(task.wrong_answer(2 * a + 7, rng)) + [eos],
                  "arith", "") for a in range(3, 3 + 9 * n, 9)]
    return ref.logprobs(pairs_batch(pairs, tok.pad_token_id))


def test_dpo_loss_matches_a_direct_forward_and_ignores_micro_batching(model_dir):
    """At the start the policy is the reference: loss ln 2, zero margin. One optimizer step over 8
    pairs gives the same loss and gradient in one micro-batch or one pair at a time, packed or not,
    and its loss is dpo_loss of summed logprobs from a plain transformers forward."""
    from dataclasses import replace

    from engine import algos

    cfg = load_config(None, ["data.prompts_per_step=8", "actor.mini_batch_prompts=8", "actor.grad_clip=1e9",
                             "dpo.beta=0.5", "actor.lr=1e-2"])
    actor, ref = ActorRollout(cfg, str(model_dir)), Reference(cfg, str(model_dir))
    batch = dpo_batch(actor, ref, 8)
    assert len(set(batch.response_mask.sum(1).tolist())) > 1, "the equivalence needs mixed lengths"
    start = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    before = actor.dpo_eval(batch.rows(slice(None)))
    assert before["sums"]["loss"] / 8 == pytest.approx(math.log(2), abs=1e-6)
    assert before["sums"]["reward_margin"] == pytest.approx(0, abs=1e-6)
    # pretend the reference is another model, so the loss is not at its symmetric point
    batch.ref_logprobs = batch.ref_logprobs + 0.3 * torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask
    results = []
    for pack, budget in [(False, 4096), (True, 4096), (False, 26), (True, 20)]:  # small: one pair per micro-batch
        actor.cfg = replace(cfg, actor=replace(cfg.actor, pack_sequences=pack, micro_batch_tokens_per_gpu=budget))
        actor.engine.model.load_state_dict(start)
        out = actor.dpo_update(batch.rows(slice(None)))
        results.append((out["sums"], [p.grad.clone() for p in actor.engine.model.parameters()]))
    for sums, grads in results[1:]:
        assert sums == pytest.approx(results[0][0], rel=1e-5, abs=1e-6)
        for a, b in zip(grads, results[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    ids, mask, pos = batch.sequences()
    with torch.no_grad():
        logits = ref.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # ref holds the start weights
    width = batch.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(-1, batch.response_ids[..., None])[..., 0]
    seq = (logp * batch.response_mask).sum(1).view(-1, 2)
    ref_seq = (batch.ref_logprobs * batch.response_mask).sum(1).view(-1, 2)
    loss, m = algos.dpo_loss(seq[:, 0], seq[:, 1], ref_seq[:, 0], ref_seq[:, 1], 0.5)
    assert results[0][0]["loss"] / 8 == pytest.approx(float(loss), rel=1e-5)
    assert results[0][0]["reward_margin"] / 8 == pytest.approx(float(m["rewards/margin"]), rel=1e-4, abs=1e-6)
    changed = [k for k, v in actor.engine.model.state_dict().items() if not torch.equal(v, start[k])]
    assert changed, "the update must change the policy"

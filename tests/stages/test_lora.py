"""LoRA on the policy (`actor.lora_rank`), through the stage verbs in-process: only the adapters
train, the base never changes, the base with adapters off is the reference, the rollout engine
generates with the merged weights, and checkpoints and exports round-trip."""

import pytest
import torch

from rlflow.engine import algos
from rlflow.engine.batch import RolloutRequest
from rlflow.engine.config import load_config
from rlflow.engine.data.prompts import load_prompts
from rlflow.engine.train import lora
from rlflow.engine.train.fsdp import response_logprobs
from rlflow.engine.train.losses import PolicyGradient, Supervised
from rlflow.stages.advantage import Advantage
from rlflow.stages.hybrid import HybridPolicy
from rlflow.stages.policy import Policy
from rlflow.stages.reference import Reference
from rlflow.stages.reward import Reward

LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def lora_cfg(tmp_path, *extra):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # a random policy scores 0 on arithmetic
    return load_config(None, [f"reward.function={tmp_path}/length_reward.py:compute_score", "actor.lora_rank=4",
                              "actor.lora_alpha=8", "data.prompts_per_step=8", "actor.mini_batch_prompts=8",
                              "rollout.samples_per_prompt=4", "actor.kl_loss_coef=0.1", "actor.lr=5e-2",
                              "data.max_prompt_tokens=16", *extra])


def grpo_step(actor, reward, adv, prompts, step):
    batch = actor.generate(RolloutRequest(prompts, step=step))
    batch = actor.logprobs(reward.score(batch))
    return actor.update(adv.estimate(batch), PolicyGradient(actor.cfg)), batch


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_lora_trains_only_the_adapters_and_the_engine_generates_with_them(model_dir, data_files, tmp_path, backend):
    cfg = lora_cfg(tmp_path, f"rollout.backend={backend}")
    actor, reward, adv = HybridPolicy(cfg, str(model_dir)), Reward(cfg), Advantage(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    names = lora.adapter_names(actor.engine.model)
    assert len(names) == 2 * 7 * 4  # A and B of q, k, v, o, gate, up, down in each of the 4 layers
    params = dict(actor.engine.model.named_parameters())
    trained = {id(p) for g in actor.engine.optimizer.param_groups for p in g["params"]}
    assert trained == {id(params[n]) for n in names}, "the optimizer holds the adapters and nothing else"
    base = {n: p.detach().clone() for n, p in params.items() if n not in names}

    for step in range(3):
        out, batch = grpo_step(actor, reward, adv, prompts[:8], step)
        assert out.metrics["training/rollout_probs_diff_max"] < 1e-4, "the engine generates with the adapters"
        assert out.timing["ref"] > 0 and "actor/kl_loss" in out.metrics
    state = actor.engine.optimizer.state
    assert len(state) == len(names)
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(params[n].numel() for n in names)
    for n, v in base.items():
        assert torch.equal(params[n].detach(), v), f"{n}: the base must stay bit-identical"
    assert any(params[n].detach().abs().sum() > 0 for n in names if ".lora_B." in n), "the adapters learned"

    # the reference is the base: exactly a separately loaded base model's logprobs, so exactly its KL
    batch = actor.generate(RolloutRequest(prompts[:8], step=9))
    batch = actor.logprobs(batch)
    separate = Reference(load_config(None, []), str(model_dir)).logprobs(batch.rows(slice(None)))
    separate_ref = separate.ref_logprobs
    assert torch.equal(batch.ref_logprobs, separate_ref)
    ids, mask, pos = batch.sequences()
    policy, _ = response_logprobs(actor.engine.root, ids, mask, pos, batch.response_ids, 1.0, 4096)
    valid = batch.response_mask.bool()
    kl = algos.kl_penalty(policy, batch.ref_logprobs, "k3")[valid]
    assert torch.equal(kl, algos.kl_penalty(policy, separate_ref, "k3")[valid])
    assert kl.max() > 0, "the adapted policy is not the base"


def test_a_lora_checkpoint_and_export_round_trip(model_dir, data_files, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_cfg(tmp_path)
    actor, reward, adv = HybridPolicy(cfg, str(model_dir)), Reward(cfg), Advantage(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    for step in range(2):
        grpo_step(actor, reward, adv, prompts[:8], step)
    (tmp_path / "ckpt").mkdir()
    actor.save(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "model.safetensors").exists(), "a LoRA checkpoint holds no copy of the base"
    assert lora.adapter_rank(tmp_path / "ckpt") == 4

    # resumed: the same adapters, optimizer and version, so the next step is the same step
    fresh = HybridPolicy(cfg, str(model_dir))
    fresh.load(str(tmp_path / "ckpt"))
    assert fresh.weight_version == actor.weight_version == 2
    for (n, p), q in zip(actor.engine.model.named_parameters(), fresh.engine.model.parameters()):
        assert torch.equal(p, q), n
    a, _ = grpo_step(actor, reward, adv, prompts[8:16], 2)
    b, _ = grpo_step(fresh, reward, adv, prompts[8:16], 2)
    assert a.metrics["actor/pg_loss"] == b.metrics["actor/pg_loss"]
    assert a.metrics["actor/grad_norm"] == b.metrics["actor/grad_norm"]

    # the export: a merged HF directory and a PEFT adapter in it, each the trained model
    actor.export(str(tmp_path / "hf"))
    batch = actor.generate(RolloutRequest(prompts[:4], step=5))
    ids, mask, pos = batch.sequences()

    def logprobs(model):
        return response_logprobs(model, ids, mask, pos, batch.response_ids, 1.0, 4096)[0]

    want = logprobs(actor.engine.root)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                        tmp_path / "hf" / lora.ADAPTER_DIR)
    torch.testing.assert_close(logprobs(merged), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs(adapted.base_model.model), want, rtol=1e-5, atol=1e-5)  # the HF model in it
    assert not torch.allclose(logprobs(AutoModelForCausalLM.from_pretrained(model_dir)), want, atol=1e-3)


def test_lora_sft_learns_through_the_adapters(model_dir):
    from rlflow.engine.data.prompts import Example, examples_batch

    cfg = load_config(None, ["actor.lora_rank=8", "actor.lr=1e-2"])
    actor, loss = Policy(cfg, str(model_dir)), Supervised(cfg)
    tok = actor.tokenizer
    batch = examples_batch([Example(tok.encode(f"{a}+{a}="), tok.encode(str(2 * a)) + [tok.eos_token_id])
                            for a in range(16)], tok.pad_token_id)
    losses = [actor.update(batch, loss).metrics["sft/loss"] for _ in range(20)]
    assert losses[-1] < losses[0] * 0.8


@pytest.mark.parametrize("setting, message", [
    (["actor.lora_targets=[nonexistent_proj]"], "matches no module"),
    (["actor.lora_rank=512"], "larger than"),
])
def test_bad_lora_settings_fail_clearly(model_dir, setting, message):
    cfg = load_config(None, ["actor.lora_rank=8", *setting])
    with pytest.raises(ValueError, match=message):
        Policy(cfg, str(model_dir))


def test_lora_dpo_anchors_to_the_base(model_dir):
    """DPO with LoRA runs no Reference stage: the policy's base is the anchor, so at the start the
    loss is ln 2, and after updates the batch's reference logprobs are still the base model's."""
    import math

    from rlflow.engine.data import task
    from rlflow.engine.data.prompts import Pair, pairs_batch
    from rlflow.engine.train.losses import Preference

    cfg = load_config(None, ["actor.lora_rank=8", "actor.lr=1e-2", "data.prompts_per_step=8",
                             "actor.mini_batch_prompts=8"], job="dpo")
    actor = Policy(cfg, str(model_dir))
    assert actor.own_reference
    tok, eos, rng = actor.tokenizer, actor.tokenizer.eos_token_id, __import__("random").Random(0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pairs = [Pair(enc(f"{a}+{a + 7}="), enc(str(2 * a + 7)) + [eos], enc(task.wrong_answer(2 * a + 7, rng)) + [eos],
                  "arith", "") for a in range(3, 75, 9)]
    loss = Preference(cfg)
    assert actor.evaluate(pairs_batch(pairs, tok.pad_token_id), loss).metrics["dpo/loss"] == pytest.approx(math.log(2))
    losses = [actor.update(pairs_batch(pairs, tok.pad_token_id), loss).metrics["dpo/loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    batch = pairs_batch(pairs, tok.pad_token_id)
    actor.evaluate(batch, loss)
    separate = Reference(load_config(None, []), str(model_dir)).logprobs(pairs_batch(pairs, tok.pad_token_id))
    assert torch.equal(batch.ref_logprobs, separate.ref_logprobs)


def test_adapters_start_from_the_run_seed(model_dir):
    """A rerun (or a resume, or another rank) draws the same initial adapters; another seed others."""
    def adapters(*extra):
        policy = Policy(load_config(None, ["actor.lora_rank=4", *extra]), str(model_dir))
        return [p.detach().clone() for n, p in policy.engine.model.named_parameters() if ".lora_A." in n]

    torch.manual_seed(123)
    first = adapters()
    torch.manual_seed(456)  # whatever the process's RNG did before
    assert all(torch.equal(a, b) for a, b in zip(first, adapters()))
    assert not any(torch.equal(a, b) for a, b in zip(first, adapters("trainer.seed=1")))


def test_a_bf16_base_trains_when_the_first_forward_is_the_reference(model_dir, data_files, tmp_path):
    """A bf16 base with float32 adapters (the GPU layout, here on the CPU) and a KL term: the first
    forward FSDP2 sees is the reference's, adapters off. Switching them off must leave every
    parameter's requires_grad alone: FSDP2 fixes a unit's gradient dtypes from its trainable
    parameters at that first forward, and a frozen adapter then would get bf16 gradients."""
    cfg = lora_cfg(tmp_path, "model.dtype=bfloat16", "rollout.dtype=bfloat16")
    actor, reward, adv = HybridPolicy(cfg, str(model_dir)), Reward(cfg), Advantage(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    trained = {n for n, p in actor.engine.model.named_parameters() if p.requires_grad}
    with lora.adapters_off(actor.engine.model):
        assert {n for n, p in actor.engine.model.named_parameters() if p.requires_grad} == trained
    out, _ = grpo_step(actor, reward, adv, prompts[:8], 0)
    assert out.metrics["actor/grad_norm"] > 0
    assert {p.grad.dtype for p in actor.engine.model.parameters() if p.grad is not None} <= {torch.float32}

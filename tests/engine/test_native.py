"""What only the native engine has: its own model code against transformers, its top-k/top-p mask, its
KV cache. The `RolloutEngine` contract it shares with the other backends: test_rollout_contract.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.native import NativeRollout, filter_logits
from engine.native_model import NativeCausalLM
from engine.rollout import SamplingParams


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def native_logits(model: NativeCausalLM, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    with torch.no_grad():
        return model.logits(model(t, torch.arange(len(ids))[None]))[0]


def test_logits_match_transformers(model_dir, hf, tok):
    model = NativeCausalLM.from_pretrained(model_dir)
    for text in ["1", "12+7=", "a longer prompt, 123+456=579"]:
        ids = tok.encode(text)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(native_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_filter_logits_keeps_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.1)).tolist() == [[True, False, False, False]]


def test_load_from_live_module_and_release_resume(model_dir, hf, tok):
    fresh = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)  # different random weights
    model = NativeCausalLM.from_pretrained(model_dir)
    engine = NativeRollout(model, tok, max_slots=2, max_len=32)
    ids = tok.encode("12+7=")
    engine.load_weights(fresh.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(native_logits(model, ids), fresh(input_ids=torch.tensor([ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    engine.load_weights(hf.named_parameters())
    with pytest.raises(ValueError, match="does not fit"):
        engine.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])
    torch.testing.assert_close(native_logits(model, ids), native_logits(NativeCausalLM.from_pretrained(model_dir), ids))
    params = SamplingParams(temperature=0, max_new_tokens=6)
    before = engine.generate([ids], params)[0][0].token_ids
    engine.release_memory()
    assert engine.cache.k is None
    with pytest.raises(RuntimeError):
        engine.generate([ids], params)
    engine.resume_memory()
    assert engine.generate([ids], params)[0][0].token_ids == before
    with pytest.raises(ValueError, match="max_len"):  # prompt + max_new_tokens must fit a slot
        engine.generate([ids], SamplingParams(max_new_tokens=40))


def test_qwen3_and_llama_configs_match_transformers(tmp_path, tok):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    configs = [Qwen3Config(head_dim=32, tie_word_embeddings=True, **common),
               LlamaConfig(attention_bias=True, tie_word_embeddings=False, **common)]
    for i, cfg in enumerate(configs):
        torch.manual_seed(i)
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in ref.parameters():  # biases and norms start at constants; make them matter
                p.add_(torch.randn_like(p) * 0.02)
        ref.save_pretrained(tmp_path / cfg.model_type)
        model = NativeCausalLM.from_pretrained(tmp_path / cfg.model_type)
        ids = tok.encode("99+1=100")
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(native_logits(model, ids), want, atol=1e-4, rtol=1e-4)


def test_unsupported_rope_scaling_is_refused(tok):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(NotImplementedError, match="yarn"):
        NativeCausalLM(cfg)

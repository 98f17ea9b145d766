import torch
from conftest import trainer_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.rollout import HFRollout, SamplingParams


def make(model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return HFRollout(model, tok), model, tok


def test_samples_are_grouped_seeded_and_logprobs_match_training(model_dir):
    rollout, model, tok = make(model_dir)
    prompts = [tok.encode("12+7="), tok.encode("3+4=")]
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, n=3, max_new_tokens=6, seed=5)
    groups = rollout.generate(prompts, params)
    assert [len(g) for g in groups] == [3, 3]
    again = rollout.generate(prompts, params)
    assert [c.token_ids for g in groups for c in g] == [c.token_ids for g in again for c in g]
    flat = [c for g in groups for c in g]
    for c in flat:
        assert len(c.token_ids) == len(c.logprobs) <= 6
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")
        assert tok.eos_token_id not in c.token_ids[:-1]
    # the trainer recomputes the same per-token logprobs from the same weights
    logp = trainer_logprobs(model, prompts, 3, flat, tok.pad_token_id, 0.7)
    for i, c in enumerate(flat):
        torch.testing.assert_close(logp[i, :len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-5, rtol=1e-4)


def test_greedy_and_stop_strings(model_dir):
    rollout, _, tok = make(model_dir)
    prompt = tok.encode("1+1=")
    a = rollout.generate([prompt], SamplingParams(temperature=0, max_new_tokens=5))[0][0]
    b = rollout.generate([prompt], SamplingParams(temperature=0, max_new_tokens=5, seed=9))[0][0]
    assert a.token_ids == b.token_ids  # greedy ignores the seed
    first = tok.decode(a.token_ids[:1])
    cut = rollout.generate([prompt], SamplingParams(temperature=0, max_new_tokens=5, stop_strings=[first]))[0][0]
    if a.token_ids[0] != tok.eos_token_id:
        assert cut.token_ids == a.token_ids[:1] and cut.finish_reason == "stop"

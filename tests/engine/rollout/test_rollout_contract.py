"""The `RolloutEngine` contract of engine/rollout/base.py, checked the same way on every backend present.

hf and native always run; vllm runs when its extra is installed, and is skipped otherwise. Everything
is fp32 on CPU with the tiny embedded model, except the sampling test, which uses a 13-token
vocabulary so the exact distribution of a first sampled token can be checked by a chi-square test.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import trainer_logprobs
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlflow.engine import progress
from rlflow.engine.data import task
from rlflow.engine.rollout.base import Completion, HFRollout, RolloutEngine, SamplingParams
from rlflow.engine.rollout.build import checked
from rlflow.engine.rollout.native import NativeRollout

NO_VLLM = importlib.util.find_spec("vllm") is None
BACKENDS = ["hf", "native", pytest.param("vllm", marks=pytest.mark.skipif(NO_VLLM, reason="vllm extra not installed"))]
TEXTS = ["1+1=", "12+7=", "3+4=", "99+99=", "5+", "0+0=", "42+58="]


def build(backend: str, model_dir: Path, tok, max_len: int = 160, native_slots: int = 3) -> RolloutEngine:
    if backend == "hf":
        return HFRollout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tok)
    if backend == "native":  # by default fewer slots than prompts, so finished rows' slots are refilled
        return NativeRollout(model_dir, tok, max_slots=native_slots, max_len=max_len)
    from rlflow.engine.rollout.vllm import VLLMRollout

    return VLLMRollout(model_dir, tok, max_len, torch.float32)


def tokens(groups: list[list[Completion]]) -> list[list[int]]:
    return [c.token_ids for g in groups for c in g]


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    """The trainer's view of the same weights."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(backend, model_dir, tok) -> RolloutEngine:
    return build(backend, model_dir, tok)


def assert_logprobs_match(hf, prompts, n, flat, tok, temperature):
    """Rollout logprobs against the trainer's recomputation: mean |Δ| < 1e-4, max < 1e-3 (fp32)."""
    logp = trainer_logprobs(hf, prompts, n, flat, tok.pad_token_id, temperature)
    diff = torch.cat([(logp[i, :len(c.logprobs)] - torch.tensor(c.logprobs)).abs() for i, c in enumerate(flat)])
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, (diff.mean(), diff.max())


def test_samples_are_grouped_seeded_and_logprobs_match_training(engine, hf, tok):
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, n=3, max_new_tokens=8, seed=5)
    groups = engine.generate(prompts, params)
    assert [len(g) for g in groups] == [3, 3, 3]
    assert all(len({tuple(c.token_ids) for c in g}) > 1 for g in groups)  # n draws, not n copies
    assert tokens(groups) == tokens(engine.generate(prompts, params))
    assert tokens(groups) != tokens(engine.generate(prompts, replace(params, seed=6)))
    flat = [c for g in groups for c in g]
    stops = {tok.eos_token_id}
    for c in flat:
        assert len(c.token_ids) == len(c.logprobs) <= 8 and not stops & set(c.token_ids[:-1])
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stops else "length")
        assert c.finish_reason == "stop" or len(c.token_ids) == 8
    # row i*n+j is sample j of prompt i: the trainer, told so, recomputes the same logprobs
    assert_logprobs_match(hf, prompts, 3, flat, tok, 0.7)


def test_greedy_is_token_identical_to_transformers_generate(engine, hf, tok):
    prompts = [tok.encode(t) for t in TEXTS]
    extra = [17, 62, 73]  # these end some rows early, so the others decode alongside refilled slots
    stops = [tok.eos_token_id, *extra]
    got = engine.generate(prompts, SamplingParams(temperature=0, n=2, max_new_tokens=12, stop_token_ids=extra))
    for p, group in zip(prompts, got):
        with torch.no_grad():  # one prompt at a time: no padding on the reference side
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=stops,
                              pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert [c.token_ids for c in group] == [out, out]
        assert group[0].finish_reason == ("stop" if out[-1] in stops else "length")
    assert len({len(g[0].token_ids) for g in got}) > 2 and any(g[0].finish_reason == "stop" for g in got)
    assert_logprobs_match(hf, prompts, 1, [g[0] for g in got], tok, 1.0)  # greedy reports temperature 1


def test_stop_tokens_strings_and_max_new_tokens(engine, tok):
    prompt = tok.encode("1+1=")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6 and tok.eos_token_id not in free.token_ids
    stop_tok = free.token_ids[2]
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop_tok]))[0][0]
    first = free.token_ids.index(stop_tok)
    assert cut.token_ids == free.token_ids[:first + 1] and cut.finish_reason == "stop"
    text = tok.decode(free.token_ids[:2])
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6, stop_strings=[text]))[0][0]
    assert cut.token_ids == free.token_ids[:len(cut.token_ids)] and len(cut.token_ids) <= 2
    assert tok.decode(cut.token_ids).endswith(text) and cut.finish_reason == "stop"
    short = engine.generate([prompt] * 2, SamplingParams(n=4, max_new_tokens=3, seed=1))
    assert all(len(c.token_ids) == 3 for g in short for c in g if c.finish_reason == "length")
    assert all(len(c.token_ids) <= 3 and len(c.logprobs) == len(c.token_ids) for g in short for c in g)
    # a prompt's own limit: greedy, so each row is the free run's prefix, cut at its limit
    own = engine.generate([prompt] * 3, SamplingParams(temperature=0, max_new_tokens=6, limits=[2, 6, 4]))
    assert [g[0].token_ids for g in own] == [free.token_ids[:2], free.token_ids, free.token_ids[:4]]
    assert [g[0].finish_reason for g in own] == ["length"] * 3
    with pytest.raises(ValueError, match="limits needs one value"):
        engine.generate([prompt], SamplingParams(max_new_tokens=6, limits=[7]))


@pytest.fixture(scope="module")
def new_weights(hf, tok, tmp_path_factory):
    """Other random weights: the module and its HF directory."""
    torch.manual_seed(1)
    new = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    d = tmp_path_factory.mktemp("new")
    new.save_pretrained(d)
    tok.save_pretrained(d)
    return new, d


@pytest.fixture(scope="module")
def fresh(backend, new_weights, tok) -> RolloutEngine:
    """An engine built on the new weights. Module-scoped: shutting a vLLM engine down tears down
    process-wide state that the other engines in this process still use."""
    return build(backend, new_weights[1], tok)


def test_weight_push_matches_an_engine_built_on_the_new_weights(engine, fresh, new_weights, hf, tok):
    # the long prompt fills a whole KV block (128 tokens in vLLM on CPU), which prefix caching then
    # keeps: K/V computed with the old weights must not be reused after the push
    prompts = [tok.encode(TEXTS[1] * 27), tok.encode(TEXTS[0])]
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=6, seed=3)
    before = engine.generate(prompts, params)
    engine.load_weights(new_weights[0].named_parameters())
    after = engine.generate(prompts, params)
    assert tokens(after) != tokens(before)
    want = fresh.generate(prompts, params)
    assert tokens(after) == tokens(want)
    torch.testing.assert_close([c.logprobs for g in after for c in g], [c.logprobs for g in want for c in g])
    assert_logprobs_match(new_weights[0], prompts, 2, [c for g in after for c in g], tok, 0.8)
    engine.load_weights(hf.named_parameters())
    assert tokens(engine.generate(prompts, params)) == tokens(before)


def test_release_and_resume_keep_the_output(engine, tok):
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompt = tok.encode("12+7=")
    before = engine.generate([prompt], params)[0][0].token_ids
    engine.release_memory()
    try:  # an engine with something to release refuses to generate; one without keeps working
        assert engine.generate([prompt], params)[0][0].token_ids == before
    except RuntimeError:
        pass
    engine.resume_memory()
    assert engine.generate([prompt], params)[0][0].token_ids == before


def test_generating_counts_its_work_as_it_goes_for_the_watchdog(engine, backend, tok):
    before = progress.done()
    engine.generate([tok.encode("12+7=")], SamplingParams(temperature=0, max_new_tokens=6))
    assert progress.done() - before >= 6  # a tick per token or engine step, on every backend


def test_an_engine_declares_what_it_can_do_and_a_false_claim_is_refused(engine, backend):
    assert checked(engine) is engine
    assert (engine.streams, engine.swaps) == ((True, True) if backend == "native" else (False, False))

    class Claims(HFRollout):
        streams = True  # with no `serve`

    with pytest.raises(TypeError, match="declares `streams` but has no `serve`"):
        checked(Claims(None, None))


# -- sampling follows the target distribution ------------------------------------------------
@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """One layer over 13 tokens (hidden 128: vLLM's CPU attention wants head_dim 32), embeddings
    spread so the first-token distribution is far from uniform."""
    d = task.build_model(tmp_path_factory.mktemp("small") / "m", seed=0, hidden=128, layers=1, chars="0123456789")
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.03)  # tied, so the lm head too: top token ~0.5
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def small(backend, small_dir):
    tok = AutoTokenizer.from_pretrained(small_dir)
    return build(backend, small_dir, tok, max_len=16, native_slots=256), tok


def target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact first-token distribution [V]: tempered, top-k, then top-p on what top-k left, renormalised."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    ranked, order = probs.sort(descending=True)
    kept = ranked[:p.top_k or len(ranked)]
    kept = kept / kept.sum()
    keep = int(((kept.cumsum(0) - kept) < p.top_p).sum())  # the smallest prefix whose mass reaches top_p
    out = torch.zeros_like(probs)
    out[order[:keep]] = kept[:keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.6, 1.0, 0), (1.5, 1.0, 5), (1.0, 0.8, 0),
                                                     (0.8, 0.9, 6)])
def test_first_token_follows_the_target_distribution(small, small_dir, temperature, top_p, top_k):
    engine, tok = small
    prompt = tok.encode("12")
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(small_dir)(torch.tensor([prompt])).logits[0, -1]
    params = SamplingParams(temperature, top_p, top_k, n=2000, max_new_tokens=1, seed=11)
    want = target(logits, params)
    assert 2 < int((want > 0).sum()) < len(want) or (top_p, top_k) == (1.0, 0)
    drawn = [c.token_ids[0] for c in engine.generate([prompt], params)[0]]
    counts = torch.bincount(torch.tensor(drawn), minlength=len(want)).double()
    expected = params.n * want[want > 0]
    assert expected.min() >= 5  # where the chi-square approximation holds
    assert counts[want == 0].sum() == 0  # nothing outside top-k / top-p
    assert chisquare(counts[want > 0], expected).pvalue > 1e-3, (counts, params.n * want)

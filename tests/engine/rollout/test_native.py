"""What only the native engine has: its own model code against transformers, its top-k/top-p mask and
Gumbel sampling, chunked and shared prefill, tensor parallelism, its KV cache. The `RolloutEngine`
contract it shares with the other backends: test_rollout_contract.py."""


import pytest
import torch
from conftest import leave_group, perturbed, trainer_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.model import NativeCausalLM
from rlflow.engine.rollout.native import NativeRollout
from rlflow.engine.rollout.sampling import filter_logits

TEXTS = ["1+1=", "12+7=", "3+4=", "99+99=", "5+"]

@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def native_logits(model: NativeCausalLM, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    with torch.no_grad():
        return model.logits(model(t, torch.arange(len(ids))[None]))[0].float()


def test_logits_match_transformers(model_dir, hf, tok):
    model = NativeCausalLM.from_pretrained(model_dir)
    for text in ["1", "12+7=", "a longer prompt, 123+456=579"]:
        ids = tok.encode(text)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(native_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_forwards_record_no_autograd_history(model_dir):
    """Graph capture runs the model outside inference_mode; a step that recorded history would
    keep its activations alive for as long as the captured outputs live."""
    model = NativeCausalLM.from_pretrained(model_dir)
    assert not any(p.requires_grad for p in model.parameters())
    out = model(torch.tensor([[3, 4, 5]]), torch.tensor([[0, 1, 2]]))
    assert out.grad_fn is None and not out.requires_grad


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
    assert engine.runner.cache.k is None
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


def test_gumbel_sampling_follows_the_tempered_distribution():
    from rlflow.engine.rollout.sampling import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40000, 4)
    params = SamplingParams(temperature=0.7)
    tokens, logp = sample(logits, params, torch.Generator().manual_seed(0))
    want = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    # 4-sigma band of a binomial proportion at n = 40000
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / len(tokens)).sqrt()).all(), (freq, want)
    torch.testing.assert_close(logp, torch.log(want)[tokens])


def test_chunked_prefill_of_long_prompts_matches_whole(model_dir, tok):
    """Prompts over the prefill budget go in chunk by chunk, and the sequences already running
    decode between two chunks (the shortest prompt is admitted first); the answers are those of
    whole prefills."""
    prompts = [tok.encode("123+456=579, 22+33=55, 7+8=15, 40+2="), tok.encode("1+1="), tok.encode("9+90=99, 3+")]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    whole = NativeRollout(model_dir, tok, max_slots=4, max_len=64).generate(prompts, params)
    engine = NativeRollout(model_dir, tok, max_slots=4, max_len=64, max_prefill_tokens=8)
    chunked = engine.generate(prompts, params)
    assert engine.between >= 4, engine.between  # 1 + 4 between the chunks of the 11 and the 36-token prompts
    # two slots: the long prompt takes slot 0 when the shortest answer ends, below one still
    # decoding, so the decode steps between its chunks run over its row too
    two = [prompts[0], prompts[1], tok.encode("5+")]
    limited = SamplingParams(temperature=0, max_new_tokens=10, limits=[6, 10, 2])
    whole += NativeRollout(model_dir, tok, max_slots=2, max_len=64).generate(two, limited)
    chunked += NativeRollout(model_dir, tok, max_slots=2, max_len=64, max_prefill_tokens=8).generate(two, limited)
    for a, b in zip(whole, chunked):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-5, rtol=0)


def _tp_worker(rank: int, store: str, model_dir: str, out: str, device: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlflow.engine.rollout.model import TP

    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    # a file store, which no rank hosts: with a TCP store on rank 0, rank 1 once aborted in teardown
    # under load, likely because rank 0 exited with the store first
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = NativeCausalLM.from_pretrained(model_dir, tp=TP(rank, 2), device=device)
    # on CUDA: decode replays graphs that hold the all-reduce, and the ranks agree on the slots
    engine = NativeRollout(model, tok, max_slots=4, max_len=64, memory_fraction=0.5 if device == "cuda" else 0.0)
    prompts = [tok.encode(t) for t in TEXTS[:5]]
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    sampled = engine.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=10, seed=1))
    graphs = bool(engine.runner.graphs and engine.runner.graphs.captured)
    torch.save({"greedy": greedy, "sampled": sampled, "graphs": graphs}, f"{out}.{rank}")
    del engine  # the captured graphs hold the communicator's work: drop them before tearing it down
    if device == "cuda":
        torch.cuda.synchronize()
    leave_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_tensor_parallel_generation_matches_one_process(model_dir, tok, tmp_path, device):
    """Two ranks (gloo on CPU; NCCL and CUDA graphs on 2 GPUs) each hold half the heads and half
    the MLP; they must agree with each other and with the unsplit model (fp32: tokens equal,
    logprobs to float noise)."""
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(str(tmp_path / "store"), str(model_dir), str(tmp_path / "out"), device), nprocs=2)
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    assert all(r["graphs"] for r in ranks) == (device == "cuda")
    engine = NativeRollout(model_dir, tok, max_slots=4, max_len=64, device=device, cuda_graphs=False)
    prompts = [tok.encode(t) for t in TEXTS[:5]]
    want = {"greedy": engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10)),
            "sampled": engine.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=10, seed=1))}
    for key, groups in want.items():
        flat = [c for g in groups for c in g]
        for r in ranks:
            got = [c for g in r[key] for c in g]
            assert [c.token_ids for c in got] == [c.token_ids for c in flat]
            for a, b in zip(got, flat):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_nan_weights_stop_generation_with_a_clear_error(model_dir, tok):
    model = NativeCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    engine = NativeRollout(model, tok, max_slots=2, max_len=32)
    for params in (SamplingParams(max_new_tokens=4), SamplingParams(temperature=0, max_new_tokens=4)):
        with pytest.raises(FloatingPointError, match="NaN"):
            engine.generate([tok.encode("1+1=")], params)


def test_a_continued_sequence_prefills_only_its_new_tokens(model_dir, hf, tok):
    """Turn 2 of an episode (turn 1's prompt + its sampled tokens + an observation) takes in the
    observation and the one sampled token no decode fed, through decode steps (both are at most
    FOLD tokens), and reads the rest from the slot that turn 1 left: the same tokens and logprobs
    as an engine that prefills it all, also after idle decode rows scribbled on the slots' column
    0. New weights make the cache stale: all again."""
    first = NativeRollout(model_dir, tok, max_slots=8, max_len=96, max_prefill_tokens=16)
    turn1 = first.generate([tok.encode(t) for t in TEXTS], SamplingParams(temperature=1.0, n=2, max_new_tokens=9))
    samples = [tok.encode(t) + c.token_ids for t, g in zip(TEXTS, turn1) for c in g]  # 10 histories, 8 slots
    kept = [s[:-1] in first.scheduler.histories.held.values() for s in samples]
    assert sum(kept) == 8, "the last 8 sequences to retire leave their histories in the 8 idle slots"
    observations = [tok.encode(f" -> {i * 37} ok.") for i in range(len(samples))]
    turn2 = [s + o for s, o in zip(samples, observations)]
    first.runner.cache.k[:, :, :, 0] = 7.0  # what idle decode rows do to column 0 (see NativeCausalLM.decode)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    prefilled, reused = first.scheduler.prefilled, first.scheduler.reused
    got = first.generate(turn2, greedy)
    assert first.scheduler.reused - reused == sum(len(s) - 1 for s, k in zip(samples, kept) if k)
    assert first.scheduler.prefilled - prefilled == sum(1 + len(o) if k else len(t)
                                                        for o, t, k in zip(observations, turn2, kept))
    want = NativeRollout(model_dir, tok, max_slots=8, max_len=96).generate(turn2, greedy)
    for a, b in zip(got, want):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4, rtol=1e-4)
    first.load_weights(hf.state_dict().items())  # any write: the cached K/V may be another policy's
    prefilled = first.scheduler.prefilled
    first.generate([t + [5] for t in turn2], greedy)
    assert first.scheduler.prefilled - prefilled == sum(len(t) + 1 for t in turn2)


def test_continued_rows_of_very_different_lengths_share_a_prefill(model_dir, tok):
    """One continued row near the end of its slot, another with a long new part: the short row's
    padding runs past its slot's end and is clamped there, and both match a full prefill (the
    prefill path: with FOLD 0 no new tokens go in through decode steps)."""
    engine = NativeRollout(model_dir, tok, max_slots=4, max_len=40)
    engine.scheduler.FOLD = 0
    long_prompt, short_prompt = tok.encode("12+34=46, 56+78=134, 9+9="), tok.encode("1+1=")
    first = engine.generate([long_prompt, short_prompt], SamplingParams(temperature=0.0, max_new_tokens=6))
    turn2 = [long_prompt + first[0][0].token_ids + tok.encode("!"),
             short_prompt + first[1][0].token_ids + tok.encode(" then 2+2=? and 3+3=?")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    reused = engine.scheduler.reused
    got = engine.generate(turn2, greedy)
    new = len(tok.encode(" then 2+2=? and 3+3=?"))
    assert engine.scheduler.reused - reused == len(turn2[0]) - 2 + len(turn2[1]) - 1 - new
    want = NativeRollout(model_dir, tok, max_slots=4, max_len=40).generate(turn2, greedy)
    for a, b in zip(got, want):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4, rtol=1e-4)


def test_weights_landing_between_steps_are_booked_per_token(model_dir, hf, tok):
    """Partial rollouts: new weights loaded between two engine steps. The sequences in flight go on
    (their tokens before the load drawn by the old policy, those after by the new one over the K/V
    kept), each token booked with its version; a sequence admitted after the load is the new
    policy's throughout."""
    engine = NativeRollout(model_dir, tok, max_slots=2, max_len=64)
    new = perturbed(hf)
    calls = []

    def swap() -> int:
        calls.append(1)
        if len(calls) == 4:  # steps 1-3 ran: a prefill and two decodes
            engine.load_weights(new)
        return int(len(calls) >= 4)

    engine.swap = swap
    prompts = sorted((tok.encode(t) for t in TEXTS[:4]), key=len)  # the engine's order: the first two go first
    out = [g[0] for g in engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))]
    assert all(len(c.token_ids) == 10 for c in out), "the tiny model's greedy answers run to the limit"
    assert [c.versions for c in out] == [[0] * 3 + [1] * 7] * 2 + [[1] * 10] * 2
    new_hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new_hf.load_state_dict(dict(new), strict=False)
    old_lp = trainer_logprobs(hf, prompts, 1, out, tok.pad_token_id, 1.0)
    new_lp = trainer_logprobs(new_hf, prompts, 1, out, tok.pad_token_id, 1.0)
    for i, c in enumerate(out):
        got = torch.tensor(c.logprobs)
        if i < 2:  # in flight: the old policy's, then neither's alone (new weights over old K/V)
            torch.testing.assert_close(got[:3], old_lp[i, :3], atol=1e-4, rtol=1e-4)
            assert not torch.allclose(got[3:], old_lp[i, 3:10], atol=1e-3)
        else:
            torch.testing.assert_close(got, new_lp[i, :10], atol=1e-4, rtol=1e-4)



def test_sequences_move_to_lower_slots_as_others_retire(model_dir, hf, tok):
    """Twelve prompts in 16 slots whose answers end one after another, the longest in the highest
    slots: as sequences retire, the running ones move down, so decode runs over fewer rows. Each
    answer is still the one a one-slot engine gives (greedy) and scores as the trainer does
    (sampled); each retired answer's history is kept through the moves, and a second turn
    continues every one of them from its cache."""
    prompts = [tok.encode(f"{i}+{3 * i}=") for i in range(12)]
    limits = [2 * i + 1 for i in range(12)]
    engine = NativeRollout(model_dir, tok, max_slots=16, max_len=96)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, limits=limits)
    got = engine.generate(prompts, greedy)
    assert engine.scheduler.moved >= 4, engine.scheduler.moved  # at 8 running, the four in slots 8-11 go down
    want = NativeRollout(model_dir, tok, max_slots=1, max_len=96).generate(prompts, greedy)
    for a, b in zip(got, want):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4, rtol=1e-4)

    histories = [p + g[0].token_ids[:-1] for p, g in zip(prompts, got)]
    assert sorted(engine.scheduler.histories.held.values()) == sorted(histories)
    turn2 = [p + g[0].token_ids + tok.encode(" ok") for p, g in zip(prompts, got)]
    reused = engine.scheduler.reused
    again = engine.generate(turn2, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert engine.scheduler.reused - reused == sum(map(len, histories))
    fresh = NativeRollout(model_dir, tok, max_slots=16, max_len=96).generate(turn2, SamplingParams(
        temperature=0.0, max_new_tokens=4))
    assert [g[0].token_ids for g in again] == [g[0].token_ids for g in fresh]

    moved = engine.scheduler.moved
    sampled = SamplingParams(temperature=1.0, n=2, max_new_tokens=24, limits=limits, seed=4)
    flat = [c for g in engine.generate(prompts, sampled) for c in g]
    assert engine.scheduler.moved > moved
    logp = trainer_logprobs(hf, prompts, 2, flat, tok.pad_token_id, 1.0)
    diff = torch.cat([(logp[i, :len(c.logprobs)] - torch.tensor(c.logprobs)).abs() for i, c in enumerate(flat)])
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, (diff.mean(), diff.max())


def test_prompts_of_like_lengths_share_a_prefill_step(model_dir, tok):
    """Fresh prompts queue shortest first, so a prefill step holds prompts of like lengths and pads
    little; the answers are those of first-come order."""
    prompts = [tok.encode("12+34=46, 5+6=11, 7+8=" if i % 2 else f"{i}+1=") for i in range(8)]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    engines = [NativeRollout(model_dir, tok, max_slots=8, max_len=64, max_prefill_tokens=64) for _ in range(2)]
    engines[1].scheduler.SORT = False  # first come, first prefilled: each step pairs a short prompt with a long one
    got, fifo = (e.generate(prompts, params) for e in engines)
    padded = [e.runner.padded for e in engines]
    assert padded[0] == engines[0].scheduler.prefilled < padded[1], padded
    for a, b in zip(got, fifo):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-5, rtol=0)


def test_samples_waiting_for_a_slot_copy_a_running_siblings_prompt(model_dir, hf, tok):
    """With fewer slots than samples, a prompt's samples that wait for a slot take its K/V from a
    running sibling's slot instead of a prefill of their own: each prompt is prefilled once. The
    answers are those of an engine with a slot for every sample (greedy), and sampled ones score as
    the trainer does."""
    prompts = [tok.encode(t) for t in ("12+34=46, 5+6=", "1+1=", "99+99=198, 7+")]
    # 12 samples in 10 slots, queued by sample then length: the last samples of the two longer
    # prompts wait, and take slots when those of the shortest retire, while their siblings run
    limits = [12, 3, 8]
    greedy = SamplingParams(temperature=0, n=4, max_new_tokens=12, limits=limits)
    engine = NativeRollout(model_dir, tok, max_slots=10, max_len=64)
    got = engine.generate(prompts, greedy)
    sched = engine.scheduler
    assert sched.fanned == 2, sched.fanned
    assert sched.prefilled - sched.fanned == sum(map(len, prompts)), (sched.prefilled, sched.fanned)
    each = NativeRollout(model_dir, tok, max_slots=10, max_len=64)
    each.scheduler.FAN = False
    each.generate(prompts, greedy)
    # without: those two prefilled again
    assert each.scheduler.prefilled > engine.scheduler.prefilled - engine.scheduler.fanned
    want = NativeRollout(model_dir, tok, max_slots=12, max_len=64).generate(prompts, greedy)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4)

    sampled = SamplingParams(temperature=1.0, n=4, max_new_tokens=12, limits=limits, seed=3)
    fanned = engine.scheduler.fanned
    flat = [c for g in engine.generate(prompts, sampled) for c in g]
    assert engine.scheduler.fanned > fanned
    logp = trainer_logprobs(hf, prompts, 4, flat, tok.pad_token_id, 1.0)
    diff = torch.cat([(logp[i, :len(c.logprobs)] - torch.tensor(c.logprobs)).abs() for i, c in enumerate(flat)])
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, (diff.mean(), diff.max())


def test_prefill_graph_widths_are_few_and_pad_by_less_than_a_quarter():
    from rlflow.engine.rollout.graphs import PrefillGraphs

    widths = [PrefillGraphs.width(n) for n in range(1, 8193)]
    assert all(n <= w < n + max(16, n / 4) for n, w in enumerate(widths, 1)), "below n, or a quarter over"
    assert widths == sorted(widths) and widths[127] == 128 and widths[128] == 160
    assert len(set(widths)) == 8 + 4 * 6  # 16 to 128 by 16, then four an octave up to 8,192

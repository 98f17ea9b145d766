"""The Triton decode kernels against the eager paths they replace, on a GPU."""

import inspect

import pytest
import torch

from rlflow.engine.rollout import kernels, model
from rlflow.engine.rollout.model import decode_attention, decode_mask

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (12, 2, 128), (4, 4, 64), (28, 4, 128)])
def test_decode_attention_writes_the_step_and_matches_eager(heads, kv_heads, dim, splits, rotate):
    torch.manual_seed(0)
    B, slots, L = 37, 40, 1400
    k = torch.randn(slots, kv_heads, L, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # q and the step's K/V as views of one projection's output, as the decoder layer passes them
    qkv = torch.randn(B, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    q, k_new, v_new = (t.view(B, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    lens = torch.randint(0, L - 1, (B,), device="cuda")
    lens[:5] = torch.tensor([0, 63, 64, 1024, 1025])  # only this step's token; block and piece edges
    rope = {}
    want_q, want_k_new = q, k_new
    if rotate:  # RoPE tables by position, each row rotated at its own, in the kernel and eagerly
        angles = torch.arange(L, device="cuda")[:, None] * 10_000 ** -(torch.arange(0, dim, 2, device="cuda") / dim)
        angles = torch.cat([angles, angles], -1)
        rope = {"cos": angles.cos().bfloat16(), "sin": angles.sin().bfloat16()}
        cos, sin = (rope[name][lens][:, None, None].float() for name in ("cos", "sin"))
        exact = eager(model.rope)(q[:, None].float(), k_new[:, None].float(), cos, sin)
        want_q, want_k_new = (t[:, 0].bfloat16() for t in exact)
    want_k, want_v = k.clone(), v.clone()
    rows = torch.arange(B, device="cuda")
    want_k[rows, :, lens], want_v[rows, :, lens] = want_k_new, v_new
    mask = decode_mask(lens, L, torch.bfloat16)
    want = decode_attention(want_q.reshape(B, kv_heads, -1, dim), want_k[:B], want_v[:B], mask).view(B, heads, dim)

    got = kernels.decode_attention(q, k_new, v_new, k, v, lens, splits, **rope)

    assert torch.equal(v, want_v)  # the step's K/V written, nothing else
    if rotate:  # within one bf16 rounding of the exact rotation
        torch.testing.assert_close(k, want_k, atol=1e-6, rtol=2**-7)
    else:
        assert torch.equal(k, want_k)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_long_rows_split_over_programs_in_a_replayed_graph():
    """A few long rows (a step's long tail) go over many programs each; replayed in a CUDA graph, the
    pieces' tallies start from zero at every replay and every layer."""
    torch.manual_seed(0)
    B, KV, H, D, L, layers = 3, 2, 14, 64, 8192, 3
    caches = [torch.randn(2, B, KV, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = torch.randn(2, B, KV, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([8000, 300, 4097], device="cuda")
    outs = [torch.empty_like(q) for _ in range(layers)]

    def step():
        for (k, v), out in zip(caches, outs):
            out.copy_(kernels.decode_attention(q, k_new, v_new, k, v, lens))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    mask = decode_mask(lens, L, torch.bfloat16)
    for _ in range(3):
        graph.replay()
        for (k, v), out in zip(caches, outs):
            want = decode_attention(q.view(B, KV, -1, D), k, v, mask).view(B, H, D)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not kernels._counts[q.device].any()


def draw(logits: torch.Tensor, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    uniform = torch.rand(len(logits), generator=torch.Generator("cuda").manual_seed(seed), device="cuda")
    return kernels.categorical_sample(logits, torch.tensor([1 / temperature], device="cuda"), uniform)


def test_categorical_sample_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]], device="cuda").expand(200_000, 5).bfloat16()
    tokens, logp = draw(logits, 0.7, seed=0)
    want = torch.softmax(logits[0].float() / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    # 4-sigma band of a binomial proportion at n = 200000
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / len(tokens)).sqrt() + 1e-9).all(), (freq, want)
    torch.testing.assert_close(logp, torch.log(want)[tokens])
    again, _ = draw(logits, 0.7, seed=0)
    assert torch.equal(tokens, again)


def test_categorical_sample_over_a_real_vocabulary():
    """Likely tokens in different vocabulary chunks (and the last one): token ids come back right
    through the chunking, and logprobs match a full log_softmax."""
    V, n = 151_936, 10_000
    row = torch.full((V,), -20.0, device="cuda")
    hot = torch.tensor([5, 4100, 80_000, V - 1], device="cuda")
    row[hot] = torch.tensor([1.0, 0.5, 0.0, 2.0], device="cuda")
    logits = row.expand(n, V).bfloat16()
    tokens, logp = draw(logits, 1.0, seed=1)
    want = torch.softmax(logits[0].float(), -1)
    torch.testing.assert_close(logp, want.log()[tokens], atol=1e-4, rtol=1e-4)
    freq = torch.bincount(tokens, minlength=V).float() / n
    p = want[hot]
    assert ((freq[hot] - p).abs() <= 4 * (p * (1 - p) / n).sqrt()).all(), (freq[hot], p)


def eager(fn):
    return inspect.unwrap(fn)  # the plain torch function under the kernel and the compiler


@pytest.mark.parametrize("rows,tokens,width", [(1, 1, 896), (37, 1, 896), (2, 19, 3584), (5, 3, 64)])
def test_norms_and_gating_match_eager(rows, tokens, width):
    g = torch.Generator("cuda").manual_seed(0)
    x, residual = (torch.randn(rows, tokens, width, device="cuda", generator=g).bfloat16() for _ in range(2))
    weight = torch.randn(width, device="cuda", generator=g).bfloat16()
    out, total = kernels.add_rms_norm(x, residual, weight, 1e-6)
    want, want_total = eager(model.add_rms_norm)(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)  # the residual sum, rounded once as torch does
    torch.testing.assert_close(out, want)  # within a bf16 rounding: rsqrt and the sum's order
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), eager(model.rms_norm)(x, weight, 1e-6))
    gate_up = torch.randn(rows, tokens, 2 * width, device="cuda", generator=g).bfloat16()
    got = kernels.silu_mul(gate_up)
    assert got.shape == (rows, tokens, width)
    torch.testing.assert_close(got, eager(model.silu_mul)(gate_up))


@pytest.mark.parametrize("rows,tokens,heads,kv_heads,dim,shared", [(37, 1, 14, 2, 64, False),
                                                                    (2, 19, 28, 4, 128, False),
                                                                    (3, 5, 4, 4, 64, True)])
def test_rope_matches_eager_on_views_of_the_projection(rows, tokens, heads, kv_heads, dim, shared):
    """q and k as the attention makes them (views into one qkv row, not contiguous); cos and sin
    per row, or one row's for all (`shared`, read at stride 0)."""
    g = torch.Generator("cuda").manual_seed(1)
    qkv = torch.randn(rows, tokens, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).bfloat16()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k = q.view(rows, tokens, heads, dim), k.view(rows, tokens, kv_heads, dim)
    cos, sin = torch.randn(2, 1 if shared else rows, tokens, 1, dim, device="cuda", generator=g).bfloat16()
    got = kernels.rope(q, k, cos, sin)
    exact = eager(model.rope)(q.float(), k.float(), cos.float(), sin.float())  # bf16 eager rounds 3 times
    for a, b in zip(got, exact):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b, atol=1e-6, rtol=2**-8)  # one bf16 rounding of the exact value

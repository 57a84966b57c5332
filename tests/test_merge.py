"""attnforge.merge_states: exact merging of attention over disjoint key sets by their LSE."""

import math

import pytest
import torch

import attnforge
from attnforge import InvalidInputError, math_attention, merge_states
from attnforge.testing import assert_close, oracle

INF = float("inf")


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def chunk_attention(attend, q, k, v, start, end, causal):
    """Attention of all queries over keys [start, end) with the full problem's bottom-right causal mask
    (query i sees key j iff j <= i + seqlen_k - seqlen_q): the rows before r = end - (seqlen_k - seqlen_q)
    meet the chunk's own bottom-right diagonal; the rows from r on see every key of the chunk."""
    kc, vc = k[:, :, start:end], v[:, :, start:end]
    if not causal:
        return attend(q, kc, vc, False)
    seqlen_q = q.shape[2]
    r = min(max(end - (k.shape[2] - seqlen_q), 0), seqlen_q)
    parts = [attend(q[:, :, :r], kc, vc, True)] if r else []
    if r < seqlen_q:
        parts.append(attend(q[:, :, r:], kc, vc, False))
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def reference_chunk(q, k, v, causal):
    return attnforge.attention(q, k, v, causal=causal, return_lse=True, backend="reference")


def math_chunk(q, k, v, causal):
    return math_attention(q, k, v, causal=causal)


CASES = [  # (heads_q, heads_kv, seqlen_q, seqlen_k, causal, chunk boundaries)
    (4, 4, 13, 29, False, (0, 7, 29)),
    (4, 2, 13, 29, False, (0, 5, 18, 29)),
    (2, 2, 17, 17, True, (0, 6, 17)),  # rows 0..5 see no key of the second chunk
    (4, 2, 11, 31, True, (0, 9, 23, 31)),  # bottom-right: rows see no key of the last chunks
    (2, 1, 19, 7, True, (0, 3, 7)),  # seqlen_q > seqlen_k: rows 0..11 see no key at all
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5])) + "-" + "_".join(map(str, c[5])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merge_of_chunks_matches_full_attention(case, dtype, gen):
    hq, hkv, nq, nk, causal, bounds = case
    q, k, v = rand(gen, 2, hq, nq, 24, dtype=dtype), rand(gen, 2, hkv, nk, 24, dtype=dtype), rand(gen, 2, hkv, nk, 24, dtype=dtype)
    chunks = [chunk_attention(reference_chunk, q, k, v, s, e, causal) for s, e in zip(bounds, bounds[1:])]
    if causal:
        assert any(torch.isinf(lse).any() for _, lse in chunks), "the case must have rows that see no key in a chunk"
    out, lse = merge_states([o for o, _ in chunks], [lse for _, lse in chunks])
    ref_out, ref_lse, _ = oracle(q, k, v, causal=causal)
    peer_out, peer_lse = math_attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # as tests/test_api.py: rounding grows like a random walk over the reductions (keys, head dim); in fp64 the
    # peer is the oracle's own math (error 0), so this is all the bound there is
    ulps = 4 * math.sqrt(max(nk, 24))
    assert_close("out", out, ref_out, peer_out, ulps=ulps)
    assert_close("lse", lse, ref_lse, peer_lse, ulps=ulps)
    if nq > nk and causal:
        blind = slice(0, nq - nk)
        assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind]))
        assert torch.equal(lse[:, :, blind], torch.full_like(lse[:, :, blind], -INF))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5])) + "-" + "_".join(map(str, c[5])))
def test_gradients_through_merge_match_full_attention(case, gen):
    """dout and dlse through the merge and each chunk's (differentiable) math attention equal the
    gradients of attention over all keys: the merge is exact, derivatives included."""
    hq, hkv, nq, nk, causal, bounds = case
    qkv = [rand(gen, 2, h, n, 8, dtype=torch.float64).requires_grad_() for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]
    dout, dlse = rand(gen, 2, hq, nq, 8, dtype=torch.float64), rand(gen, 2, hq, nq, dtype=torch.float64)
    chunks = [chunk_attention(math_chunk, *qkv, s, e, causal) for s, e in zip(bounds, bounds[1:])]
    out, lse = merge_states([o for o, _ in chunks], [lse for _, lse in chunks])
    got = torch.autograd.grad((out, lse.masked_fill(lse == -INF, 0.0)), qkv, (dout, dlse))
    full_out, full_lse = math_attention(*qkv, causal=causal)
    want = torch.autograd.grad((full_out, full_lse.masked_fill(full_lse == -INF, 0.0)), qkv, (dout, dlse))
    for name, g, w in zip("qkv", got, want):
        assert not g.isnan().any(), f"d{name}: NaN"
        torch.testing.assert_close(g, w, msg=lambda m: f"d{name}: {m}")


def test_gradcheck_through_merge_states(gen):
    outs = rand(gen, 3, 1, 2, 5, 3, dtype=torch.float64).requires_grad_()
    lses = rand(gen, 3, 1, 2, 5, dtype=torch.float64)
    lses[0, 0, 0, 1] = -INF  # a chunk that saw no key for some rows
    lses[1, 0, 1, 3] = -INF
    lses[:2, 0, 1, 4] = -INF  # only the last chunk saw keys
    lses.requires_grad_()
    assert torch.autograd.gradcheck(merge_states, (outs, lses))
    assert torch.autograd.gradcheck(lambda o, s: merge_states(list(o.unbind(0)), list(s.unbind(0))), (outs, lses))


def test_rows_where_some_chunks_saw_no_key_take_the_others_exactly(gen):
    outs = [rand(gen, 1, 2, 4, 8), rand(gen, 1, 2, 4, 8)]
    lses = [rand(gen, 1, 2, 4), rand(gen, 1, 2, 4)]
    lses[0][0, 1, 2] = -INF
    out, lse = merge_states(outs, lses)
    assert torch.equal(out[0, 1, 2], outs[1][0, 1, 2])
    assert torch.equal(lse[0, 1, 2], lses[1][0, 1, 2])
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rows_where_every_chunk_saw_no_key_give_zero_and_minus_inf_with_finite_gradients(dtype, gen):
    outs = rand(gen, 3, 1, 2, 4, 8, dtype=dtype).requires_grad_()
    lses = rand(gen, 3, 1, 2, 4, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    lses[:, 0, 1, 2] = -INF
    lses[:, 0, 0, 0] = -INF
    lses.requires_grad_()
    out, lse = merge_states(outs, lses)
    for b, h, i in ((0, 1, 2), (0, 0, 0)):
        assert torch.equal(out[b, h, i], torch.zeros(8, dtype=dtype))
        assert lse[b, h, i] == -INF
    assert torch.isfinite(out[0, 0, 1:]).all() and torch.isfinite(lse[0, 0, 1:]).all()
    dout, dlse = rand(gen, *out.shape, dtype=dtype), rand(gen, *lse.shape, dtype=lse.dtype)
    d_outs, d_lses = torch.autograd.grad((out, lse), (outs, lses), (dout, dlse))
    assert torch.isfinite(d_outs).all() and torch.isfinite(d_lses).all()
    assert (d_outs[:, 0, 1, 2] == 0).all() and (d_lses[:, 0, 1, 2] == 0).all()


def test_nan_in_a_chunk_makes_its_row_nan(gen):
    outs = [rand(gen, 1, 2, 5, 8) for _ in range(3)]
    lses = [rand(gen, 1, 2, 5) for _ in range(3)]
    outs[1][0, 0, 1, 3] = float("nan")  # a NaN value in one chunk's output
    lses[2][0, 1, 2] = float("nan")  # a NaN LSE
    lses[0][0, 1, 4] = -INF  # a NaN output from a chunk that saw no key is still a NaN
    outs[0][0, 1, 4, 0] = float("nan")
    out, lse = merge_states(outs, lses)
    assert out[0, 0, 1].isnan().any()
    assert out[0, 1, 2].isnan().all() and lse[0, 1, 2].isnan()
    assert out[0, 1, 4].isnan().any()
    nan_rows = {(0, 1), (1, 2), (1, 4)}
    for h in range(2):
        for i in range(5):
            if (h, i) not in nan_rows:
                assert torch.isfinite(out[0, h, i]).all(), (h, i)


def test_accumulates_in_fp32_for_half_outputs(gen):
    outs = rand(gen, 3, 1, 2, 7, 16, dtype=torch.bfloat16)
    lses = rand(gen, 3, 1, 2, 7) * 4
    out, lse = merge_states(outs, lses)
    out32, lse32 = merge_states(outs.float(), lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, out32.to(torch.bfloat16))
    assert torch.equal(lse, lse32)


def test_single_chunk_is_itself(gen):
    out, lse = merge_states([o := rand(gen, 1, 2, 3, 4)], [s := rand(gen, 1, 2, 3)])
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, s)


@pytest.mark.parametrize("outs, lses, words", [
    ([], [], "empty"),
    (torch.zeros(0, 1, 2, 3, 4), torch.zeros(0, 1, 2, 3), "no chunk"),
    ([torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4)], [torch.zeros(1, 2, 3)] * 2, "outs[1]"),
    ([torch.zeros(1, 2, 3, 4)] * 2, [torch.zeros(1, 2, 3), torch.zeros(1, 2, 4)], "lses[1]"),
    ([torch.zeros(1, 2, 3, 4)] * 2, [torch.zeros(1, 2, 3)] * 3, "do not match"),
    ([torch.zeros(1, 2, 3, 4)] * 2, [torch.zeros(1, 3, 3)] * 2, "do not match"),
    ([torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float64)], [torch.zeros(1, 2, 3)] * 2, "outs[1]"),
    ([torch.zeros(1, 2, 3, 4)] * 2, [torch.zeros(1, 2, 3, device="meta")] * 2, "meta"),
    ([torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, device="meta")], [torch.zeros(1, 2, 3)] * 2, "meta"),
    ([torch.zeros(1, 2, 3, 4, dtype=torch.int32)] * 2, [torch.zeros(1, 2, 3)] * 2, "floating point"),
    ([torch.zeros(1, 2, 3, 4)] * 2, [torch.zeros(1, 2, 3, dtype=torch.bfloat16)] * 2, "float32"),
    ([torch.zeros(1, 2, 3, 4), "x"], [torch.zeros(1, 2, 3)] * 2, "not a tensor"),
    (torch.zeros(1, 2, 3, 4), 3.0, "sequence"),
])
def test_bad_inputs_are_named(outs, lses, words):
    with pytest.raises(InvalidInputError, match="merge_states.*" + words.replace("[", r"\[").replace("]", r"\]")):
        merge_states(outs, lses)


def test_exported():
    assert "merge_states" in attnforge.__all__ and attnforge.merge_states is merge_states

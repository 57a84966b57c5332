"""attention_with_kvcache: FlashAttention's KV-cache call, contiguous and paged, new tokens appended in place,
bottom-right causal against the cache length, left padding; against fp64 math on the keys each sequence has.
Cache positions no sequence owns are poisoned with NaN, so reading one shows."""

import math

import pytest
import torch

import attnforge
from attnforge import InvalidInputError
from attnforge.testing import assert_close, oracle, peer_error

B, HQ, HKV, D, NMAX, PAGE = 3, 4, 2, 16, 40, 8


def caches(gen, lengths):
    k_cache, v_cache = (torch.full((B, NMAX, HKV, D), float("nan")) for _ in range(2))
    for b, n in enumerate(lengths):
        k_cache[b, :n], v_cache[b, :n] = (torch.randn(n, HKV, D, generator=gen) for _ in range(2))
    return k_cache, v_cache


def paged(k_cache, v_cache, gen):
    """The same caches as pages of PAGE tokens in a shuffled pool, with the block table that finds them."""
    per_seq = NMAX // PAGE
    order = torch.randperm(B * per_seq + 3, generator=gen)[:B * per_seq].to(torch.int32)
    table = order.reshape(B, per_seq)
    pool_k, pool_v = (torch.full((B * per_seq + 3, PAGE, HKV, D), float("nan")) for _ in range(2))
    for b in range(B):
        for i in range(per_seq):
            pool_k[table[b, i]] = k_cache[b, i * PAGE:(i + 1) * PAGE]
            pool_v[table[b, i]] = v_cache[b, i * PAGE:(i + 1) * PAGE]
    return pool_k, pool_v, table


def check(out, lse, q, keys, values, causal):
    """Each sequence's out and LSE against fp64 math over the keys it has."""
    ulps = 4 * math.sqrt(NMAX)
    for b in range(B):
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], keys[b], values[b])]
        ref, ref_lse, _ = oracle(*bhsd, causal=causal, scale=0.3)
        peer, _ = peer_error(*bhsd, causal=causal, scale=0.3)
        assert_close("out", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close("lse", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True), (5, False)])
def test_append_then_attend(layout, seqlen_q, causal, gen):
    lengths, new = [5, 0, 17], 3
    k_cache, v_cache = caches(gen, lengths)
    before_k = [k_cache[b, :n].clone() for b, n in enumerate(lengths)]
    before_v = [v_cache[b, :n].clone() for b, n in enumerate(lengths)]
    k_new, v_new = (torch.randn(B, new, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(B, seqlen_q, HQ, D, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    kwargs = dict(cache_seqlens=seqlens, causal=causal, scale=0.3, return_lse=True)
    if layout == "paged":
        pool_k, pool_v, table = paged(k_cache, v_cache, gen)
        out, lse = attnforge.attention_with_kvcache(q, pool_k, pool_v, k_new, v_new, block_table=table, **kwargs)
        page_of = lambda b, pos: (table[b, pos // PAGE].item(), pos % PAGE)  # noqa: E731
        for b, n in enumerate(lengths):  # appended in place, in the right pages
            for j in range(new):
                page, offset = page_of(b, n + j)
                assert torch.equal(pool_k[page, offset], k_new[b, j]) and torch.equal(pool_v[page, offset], v_new[b, j])
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
        for b, n in enumerate(lengths):
            assert torch.equal(k_cache[b, :n], before_k[b]) and torch.equal(k_cache[b, n:n + new], k_new[b])
            assert k_cache[b, n + new:].isnan().all()  # untouched past the new tokens
    assert out.shape == (B, seqlen_q, HQ, D) and lse.shape == (B, HQ, seqlen_q) and out.isfinite().all()
    keys = [torch.cat((before_k[b], k_new[b])) for b in range(B)]
    values = [torch.cat((before_v[b], v_new[b])) for b in range(B)]
    check(out, lse, q, keys, values, causal)


def test_left_padding_and_no_append(gen):
    lengths, pads = [9, 4, 20], [2, 0, 7]
    k_cache, v_cache = caches(gen, lengths)
    q = torch.randn(B, 2, HQ, D, generator=gen)
    out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                                cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=True,
                                                scale=0.3, return_lse=True)
    check(out, lse, q, [k_cache[b, p:n] for b, (p, n) in enumerate(zip(pads, lengths))],
          [v_cache[b, p:n] for b, (p, n) in enumerate(zip(pads, lengths))], True)


def test_an_empty_cache_gives_zero_and_minus_inf(gen):
    k_cache, v_cache = caches(gen, [0, 0, 0])
    q = torch.randn(B, 1, HQ, D, generator=gen)
    out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=0, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_no_sequences_gives_empty_outputs(layout, dtype, gen):
    """A decode step with no sequences (an idle serving batch): empty output and LSE of the right shapes and dtypes,
    with or without an append, as attention() gives for a batch of 0."""
    k_cache, v_cache = (torch.randn(B, NMAX, HKV, D, generator=gen).to(dtype) for _ in range(2))
    table = torch.zeros(0, NMAX // PAGE, dtype=torch.int32) if layout == "paged" else None
    if table is not None:
        k_cache, v_cache = (x.reshape(-1, PAGE, HKV, D) for x in (k_cache, v_cache))
    q = torch.randn(0, 2, HQ, D, generator=gen).to(dtype)
    new = torch.randn(0, 1, HKV, D, generator=gen).to(dtype)
    for k, v in ((None, None), (new, new)):
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k, v, block_table=table, return_lse=True,
                                                    cache_seqlens=torch.zeros(0, dtype=torch.int32))
        assert out.shape == (0, 2, HQ, D) and out.dtype == dtype
        assert lse.shape == (0, HQ, 2) and lse.dtype == torch.float32


@pytest.mark.parametrize("change,match", [
    (dict(cache_seqlens=torch.tensor([5, 0, 38], dtype=torch.int32)), "does not fit"),
    (dict(cache_seqlens=torch.tensor([5, 0, 17])), "cache_seqlens must be an int or an int32"),
    (dict(cache_seqlens=41), "between 0 and the cache's 40 tokens"),
    (dict(v=None), "pass k and v together"),
    (dict(block_table=torch.zeros(3, 5)), "block_table must be an int32"),
    (dict(block_table=torch.full((3, 5), 99, dtype=torch.int32)), "names pages outside the cache's 3"),
    (dict(check_inputs="yes"), "check_inputs must be True or False"),
    (dict(num_splits=-1), "num_splits must be an int >= 0"),
])
def test_bad_inputs_are_named(change, match, gen):
    k_cache, v_cache = caches(gen, [5, 0, 17])
    args = dict(k=torch.randn(B, 3, HKV, D, generator=gen), v=torch.randn(B, 3, HKV, D, generator=gen),
                cache_seqlens=torch.tensor([5, 0, 17], dtype=torch.int32))
    args.update(change)
    with pytest.raises(InvalidInputError, match=match):
        attnforge.attention_with_kvcache(torch.randn(B, 1, HQ, D, generator=gen), k_cache, v_cache, **args)


def test_a_call_that_needs_gradients_is_refused(gen):
    k_cache, v_cache = caches(gen, [5, 0, 17])
    q = torch.randn(B, 1, HQ, D, generator=gen, requires_grad=True)
    with pytest.raises(InvalidInputError, match="has no backward"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)


def test_explain_says_what_serves_a_paged_decode_on_a_gpu_not_here():
    decision = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=1, seqlen_k=8192, batch=64,
                                 heads=32, kv_heads=8, kv_cache="paged")
    assert decision.forward.backend == "triton_fa2" and "kvcache 16x128" in str(decision)
    assert "KV cache is not supported" in str(decision)  # why the others cannot
    with pytest.raises(InvalidInputError, match="kv_cache must be one of"):
        attnforge.explain(dtype="bf16", head_dim=128, seqlen_q=1, kv_cache="ring")


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compiled_decode_appends_and_attends_as_eager(layout, compiler, gen):
    """A decode step (append one token, attend) and a read-only call under torch.compile(fullgraph=True): one custom
    op each, whose lengths are read when the graph runs (new lengths in the same tensor give their answer), with the
    caches written as an eager call writes them and outputs bitwise equal to eager's."""
    lengths = [5, 0, 17]
    k_cache, v_cache = caches(gen, lengths)
    table = None
    if layout == "paged":
        k_cache, v_cache, table = paged(k_cache, v_cache, gen)
    q = torch.randn(B, 1, HQ, D, generator=gen)
    k_new, v_new = (torch.randn(B, 1, HKV, D, generator=gen) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new, seqlens, table):
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                    block_table=table, causal=True, scale=0.3, return_lse=True)
        again = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens + 1, block_table=table,
                                                 causal=True, scale=0.3)  # read-only, after the append
        return out, lse, again

    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    caches_eager = k_cache.clone(), v_cache.clone()
    for grown in (0, 1):  # two decode steps; the same seqlens tensor, advanced in place, is read when the graph runs
        want = step(q, *caches_eager, k_new, v_new, seqlens, table)
        got = compiled(q, k_cache, v_cache, k_new, v_new, seqlens, table)
        decision = attnforge.last_decision()
        assert decision.problem.kv_cache == layout and decision.problem.seqlen_k == max(lengths) + grown + 1
        assert got[0].isfinite().all() and torch.equal(got[2], got[0])  # the read-only call sees the appended token
        for name, g, w in zip(("out", "lse", "read-only out"), got, want):
            assert torch.equal(g, w), name
        assert torch.equal(k_cache.nan_to_num(7.0), caches_eager[0].nan_to_num(7.0))  # appended alike, NaN kept
        assert torch.equal(v_cache.nan_to_num(7.0), caches_eager[1].nan_to_num(7.0))
        seqlens += 1


@pytest.mark.parametrize("appends", [False, True])
def test_opcheck_kvcache_ops(appends, gen):
    k_cache, v_cache = caches(gen, [5, 0, 17])
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # (opcheck compares caches without equal_nan)
    q = torch.randn(B, 2, HQ, D, generator=gen)
    tail = (torch.tensor([5, 0, 17], dtype=torch.int32), -1, None, None, True, 0.3, -1, -1, 0.0, None, 0, True, None,
            None, None)
    if appends:
        new = tuple(torch.randn(B, 2, HKV, D, generator=gen) for _ in range(2))
        torch.library.opcheck(torch.ops.attnforge.attention_with_kvcache_append.default,
                              (q, k_cache, v_cache, *new, *tail))
    else:
        torch.library.opcheck(torch.ops.attnforge.attention_with_kvcache.default, (q, k_cache, v_cache, *tail))

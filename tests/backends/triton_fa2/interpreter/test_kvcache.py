"""The KV-cache kernel (templates/triton_kvcache.py.jinja) of triton_fa2 and triton_rocm in Triton's interpreter,
through attention_with_kvcache in fp16, against fp64 math on the keys each sequence has: contiguous and paged
caches (pages of 16, 64 and 256 in a shuffled pool with a random block table), mixed lengths including 0 and 1,
appends, decode and chunked prefill, GQA packed into one tile, split-KV (the heuristic and forced splits),
causal, a sliding window, softcap, sinks and left padding. Every cache position no sequence owns is NaN, and
outputs are allocated NaN-filled (poisoned_empty), so a read or write out of place shows. Runs with
TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import dataclasses
import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

import attnforge  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, oracle, peer_error  # noqa: E402

from .test_interpreter import KV_TILES, module, tile_id  # noqa: E402

BACKENDS = ["triton_fa2", "triton_rocm"]
D = 32
LENGTHS = [0, 1, 17, 113]  # cached tokens per sequence before the append


def filled(gen, lengths, capacity, heads_kv):
    """Contiguous (B, capacity, heads_kv, D) fp16 caches with ``lengths`` random tokens each, NaN past them."""
    k_cache, v_cache = (torch.full((len(lengths), capacity, heads_kv, D), float("nan"), dtype=torch.float16)
                        for _ in range(2))
    for b, n in enumerate(lengths):
        for cache in (k_cache, v_cache):
            cache[b, :n] = torch.randn(n, heads_kv, D, generator=gen).half()
    return k_cache, v_cache


def as_pages(cache, table, page_size, pool):
    """The same cache as pages of ``page_size`` in a pool of ``pool`` pages (NaN where no sequence's page is)."""
    pages = torch.full((pool, page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
    for b in range(cache.shape[0]):
        for i in range(table.shape[1]):
            pages[table[b, i]] = cache[b, i * page_size:(i + 1) * page_size]
    return pages


def random_table(gen, batch, per_seq, pool):
    return torch.randperm(pool, generator=gen)[:batch * per_seq].to(torch.int32).reshape(batch, per_seq)


def expected(q, k_cache, v_cache, starts, ends, mask, scale, softcap, sinks):
    """Per sequence: fp64 math and torch's fp16 error over cache positions [start, end) of a contiguous cache."""
    outs = []
    for b in range(q.shape[0]):
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], k_cache[b, starts[b]:ends[b]], v_cache[b, starts[b]:ends[b]])]
        if ends[b] == starts[b]:  # no key: output 0, LSE -inf (or the sink's)
            lse = (torch.full((1, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64) if sinks is None
                   else sinks.double()[None, :, None].expand(1, q.shape[2], q.shape[1]))
            zero = torch.zeros_like(bhsd[0], dtype=torch.float64)
            outs.append((zero, lse, zero))
            continue
        ref, ref_lse, _ = oracle(*bhsd, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
        peer, _ = peer_error(*bhsd, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
        outs.append((ref, ref_lse, peer))
    return outs


def check(out, lse, refs, longest):
    ulps = 4 * math.sqrt(max(longest, D))
    for b, (ref, ref_lse, peer) in enumerate(refs):
        assert_close(f"out[{b}]", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


# (heads_q, heads_kv, seqlen_q, seqlen_new, causal, window, softcap, sinks, leftpad, num_splits)
CASES = [
    (8, 2, 1, 0, False, (-1, -1), 0.0, False, False, 0),  # GQA decode, the heuristic's splits
    (8, 2, 1, 1, True, (-1, -1), 0.0, False, False, 3),  # decode with an append, forced splits
    (2, 2, 5, 5, True, (-1, -1), 0.0, False, False, 1),  # chunked prefill, one split
    (4, 1, 3, 3, True, (16, -1), 0.0, False, True, 0),  # sliding window and left padding
    (4, 2, 2, 0, False, (-1, -1), 5.0, True, False, 4),  # softcap and sinks across splits
]


def case_id(case):
    hq, hkv, nq, new, causal, window, cap, sinks, pad, splits = case
    flags = [f for f, on in (("causal", causal), (f"w{window[0]}", window != (-1, -1)), (f"cap{cap:g}", cap > 0),
                             ("sinks", sinks), ("leftpad", pad)) if on]
    return f"h{hq}/{hkv}-nq{nq}-new{new}-s{splits}" + ("-" + "-".join(flags) if flags else "")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [0, 16, 64, 256], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kvcache_kernel_against_fp64(backend, page_size, case, gen, poisoned_empty):
    hq, hkv, nq, new, causal, window, cap, with_sinks, with_pad, splits = case
    batch = len(LENGTHS)
    capacity = 256 if page_size in (0, 256) else 128 + page_size  # room for the longest plus the append
    k_cache, v_cache = filled(gen, LENGTHS, capacity, hkv)
    pads = [min(n, 2 * b) for b, n in enumerate(LENGTHS)] if with_pad else [0] * batch
    q = torch.randn(batch, nq, hq, D, generator=gen).half()
    k_new, v_new = ((torch.randn(batch, new, hkv, D, generator=gen).half() for _ in range(2)) if new else (None, None))
    sinks = torch.randn(hq, generator=gen) * 2.0 if with_sinks else None
    mask = _causal_mask(causal, window)
    kwargs = dict(cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32), causal=causal, window_size=window,
                  softcap=cap, sinks=sinks, num_splits=splits, scale=0.3, return_lse=True, backend=backend)
    if with_pad:
        kwargs["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    dense_k, dense_v = k_cache.clone(), v_cache.clone()  # the oracle's copy, appended here by hand
    for b, n in enumerate(LENGTHS):
        if new:
            dense_k[b, n:n + new], dense_v[b, n:n + new] = k_new[b], v_new[b]
    if page_size:
        per_seq = capacity // page_size
        pool = batch * per_seq + 5
        table = random_table(gen, batch, per_seq, pool)
        k_pages, v_pages = as_pages(k_cache, table, page_size, pool), as_pages(v_cache, table, page_size, pool)
        out, lse = attnforge.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, block_table=table, **kwargs)
        for b, n in enumerate(LENGTHS):  # the append landed in the right pages, and nothing else changed
            assert torch.equal(torch.cat([k_pages[p] for p in table[b].tolist()]).nan_to_num(7.0),
                               dense_k[b].nan_to_num(7.0))
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
        assert torch.equal(k_cache.nan_to_num(7.0), dense_k.nan_to_num(7.0))
        assert torch.equal(v_cache.nan_to_num(7.0), dense_v.nan_to_num(7.0))
    assert attnforge.last_decision().forward.backend == backend
    ends = [n + new for n in LENGTHS]
    refs = expected(q, dense_k, dense_v, pads, ends, mask, 0.3, cap, sinks)
    assert out.shape == (batch, nq, hq, D) and lse.shape == (batch, hq, nq)
    check(out, lse, refs, max(ends))


@pytest.mark.parametrize("tile", KV_TILES, ids=tile_id)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_every_kvcache_tile_fp32(tile, paged, gen):
    """Each tile's module launched directly on fp32 (exact math in the interpreter): GQA decode rows and a
    chunked-prefill tile, causal, three splits, lengths 0 to 150."""
    lengths, hq, hkv, nq, d = [0, 1, 150], 6, 2, 3, 48  # d=48: a padded head dim
    k_cache, v_cache = (torch.randn(3, 160, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(3, nq, hq, d, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out = torch.full((3, nq, hq, d), float("nan"))
    lse = torch.full((3, hq, nq), float("nan"))
    block_n = tile[2].block_n
    per_split = -(-160 // (3 * block_n)) * block_n
    if paged:
        table = random_table(gen, 3, 10, 33)
        kc, vc = (as_pages(c, table, 16, 33).transpose(1, 2) for c in (k_cache, v_cache))
    else:
        table, kc, vc = None, k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    module(tile).launch(q.transpose(1, 2), kc, vc, out.transpose(1, 2), lse, seqlens, causal=True, scale=0.3,
                        num_splits=-(-160 // per_split), keys_per_split=per_split, block_table=table)
    for b, n in enumerate(lengths):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], k_cache[b, :n], v_cache[b, :n])]
        ref, ref_lse, _ = oracle(*bhsd, causal=True, scale=0.3)
        ulps = 4 * math.sqrt(max(n, d))
        assert_close("out", out[b].transpose(0, 1).unsqueeze(0), ref, ref.float(), ulps=ulps)
        assert_close("lse", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


# KVTile.lookahead (PAGE_LOOKAHEAD in the template), a template option no table tile takes: each KV-cache tile's
# twin with it
LOOKAHEAD_TILES = [(backend, family, dataclasses.replace(tile, lookahead=True)) for backend, family, tile in KV_TILES]


@pytest.mark.parametrize("tile", LOOKAHEAD_TILES, ids=tile_id)
@pytest.mark.parametrize("window, pads", [(None, None), ((300, 0), [0, 1, 21])], ids=["causal", "window-leftpad"])
def test_lookahead_tiles_match_their_tiles_bit_for_bit(tile, window, pads, gen):
    """Reading a key step's block-table entries a step ahead changes when the kernel reads the block table, not what
    it computes: on fp32 pages of 16 in a shuffled pool, the lookahead twin's outputs and LSEs equal its tile's bit
    for bit (that tile is checked against fp64 math above), with the block table's entries past each sequence's pages
    naming no page (-1, or past the pool: the twin reads them, and they must not reach a row). Causal decode and
    chunked-prefill rows over 2 splits of several key steps each, lengths 0 to 600; then a sliding window with left
    padding, where the first key step is where the loads say."""
    lengths, hq, hkv, nq, d, capacity, pool = [0, 1, 600], 6, 2, 3, 48, 640, 123
    k_cache, v_cache = (torch.randn(3, capacity, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(3, nq, hq, d, generator=gen)
    table = random_table(gen, 3, capacity // 16, pool)
    kc, vc = (as_pages(c, table, 16, pool).transpose(1, 2) for c in (k_cache, v_cache))
    for b, n in enumerate(lengths):  # pages no position of the sequence is in
        used = -(-n // 16)
        table[b, used:] = torch.tensor([-1, pool]).repeat(capacity // 16)[:capacity // 16 - used]
    block_n = tile[2].block_n
    per_split = -(-capacity // (2 * block_n)) * block_n
    results = []
    for entry in ((tile[0], tile[1], dataclasses.replace(tile[2], lookahead=False)), tile):
        out = torch.full((3, nq, hq, d), float("nan"))
        lse = torch.full((3, hq, nq), float("nan"))
        extra = {} if window is None else dict(window=window, leftpad=torch.tensor(pads, dtype=torch.int32))
        module(entry).launch(q.transpose(1, 2), kc, vc, out.transpose(1, 2), lse, torch.tensor(lengths, dtype=torch.int32),
                             causal=True, scale=0.3, num_splits=-(-capacity // per_split), keys_per_split=per_split,
                             block_table=table, **extra)
        results.append((out, lse))
    (out, lse), (twin_out, twin_lse) = results
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(twin_out, out) and torch.equal(twin_lse, lse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [16, 40, 80, 200])
@pytest.mark.parametrize("page_size", [0, 16], ids=lambda p: f"page{p}" if p else "contiguous")
def test_head_dims_between_the_tables_against_fp64(backend, head_dim, page_size, gen, poisoned_empty):
    """Head dims the KV-cache table has no entry of its own for run the next entry's kernel with the columns past
    head_dim masked (variants.KV_HEAD_DIMS): GQA decode with an append and chunked prefill, causal, forced splits,
    lengths 0 to 113, NaN cache positions no sequence owns."""
    lengths, hq, hkv, capacity = [0, 1, 17, 113], 4, 2, 128
    k_cache, v_cache = (torch.full((4, capacity, hkv, head_dim), float("nan"), dtype=torch.float16) for _ in range(2))
    for b, n in enumerate(lengths):
        for cache in (k_cache, v_cache):
            cache[b, :n] = torch.randn(n, hkv, head_dim, generator=gen).half()
    for nq in (1, 3):
        q = torch.randn(4, nq, hq, head_dim, generator=gen).half()
        k_new, v_new = (torch.randn(4, 1, hkv, head_dim, generator=gen).half() for _ in range(2))
        dense_k, dense_v = k_cache.clone(), v_cache.clone()
        for b, n in enumerate(lengths):
            dense_k[b, n], dense_v[b, n] = k_new[b, 0], v_new[b, 0]
        kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True, num_splits=3, scale=0.3,
                      return_lse=True, backend=backend)
        if page_size:
            table = random_table(gen, 4, capacity // page_size, 4 * capacity // page_size + 3)
            pool = table.numel() + 3
            kp, vp = as_pages(k_cache, table, page_size, pool), as_pages(v_cache, table, page_size, pool)
            out, lse = attnforge.attention_with_kvcache(q, kp, vp, k_new, v_new, block_table=table, **kwargs)
        else:
            out, lse = attnforge.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **kwargs)
        decision = attnforge.last_decision()
        assert decision.forward.backend == backend and decision.forward.variant.head_dim == head_dim
        refs = []
        for b, n in enumerate(lengths):
            bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], dense_k[b, :n + 1], dense_v[b, :n + 1])]
            ref, ref_lse, _ = oracle(*bhsd, mask=_causal_mask(True, (-1, -1)), scale=0.3)
            peer, _ = peer_error(*bhsd, mask=_causal_mask(True, (-1, -1)), scale=0.3)
            refs.append((ref, ref_lse, peer))
        ulps = 4 * math.sqrt(max(max(lengths) + 1, head_dim))
        for b, (ref, ref_lse, peer) in enumerate(refs):
            assert_close(f"out[{b}]", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
            assert_close(f"lse[{b}]", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_key_makes_its_rows_nan_across_splits(backend, gen, poisoned_empty):
    """NaN never passes: a NaN in one split's keys makes every row that sees it NaN after the combine."""
    k_cache, v_cache = filled(gen, [100, 100], 128, 1)
    k_cache[0, 70] = float("nan")
    q = torch.randn(2, 1, 2, D, generator=gen).half()
    out = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=100, num_splits=4, backend=backend)
    assert out[0].isnan().all() and out[1].isfinite().all()


def test_decision_names_the_kernel_and_why_others_cannot():
    k_cache = torch.zeros(2, 64, 2, D, dtype=torch.float16)
    q = torch.zeros(2, 1, 8, D, dtype=torch.float16)
    attnforge.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=5, backend="triton_fa2")
    decision = attnforge.last_decision()
    assert decision.problem.kv_cache == "contiguous" and "kvcache 16x64" in str(decision)  # the interpreter takes sm80's tiles
    with pytest.raises(attnforge.BackendUnavailableError, match="KV cache is not supported"):
        attnforge.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=5, backend="sdpa")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_unchecked_calls_match_checked_ones_and_bad_values_give_nan_rows(backend, paged, gen, poisoned_empty):
    """check_inputs=False (no host read, CUDA-graph capturable): the same answer on good values; a sequence whose
    length leaves the cache, or whose block table names no page, gets NaN rows and the others are untouched."""
    lengths, capacity = [30, 7, 64], 64
    k_cache, v_cache = filled(gen, lengths, capacity, 2)
    q = torch.randn(3, 2, 4, D, generator=gen).half()
    kwargs = dict(causal=True, scale=0.3, return_lse=True, backend=backend)
    if paged:
        table = random_table(gen, 3, capacity // 16, 15)
        k_cache, v_cache = as_pages(k_cache, table, 16, 15), as_pages(v_cache, table, 16, 15)
        kwargs["block_table"] = table
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    checked = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kwargs)
    unchecked = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, check_inputs=False, **kwargs)
    for a, b in zip(checked, unchecked):
        assert torch.equal(a, b)
    if paged:  # sequence 1's first page is no page of the 15
        bad_table = table.clone()
        bad_table[1, 0] = 99
        kwargs["block_table"] = bad_table
    else:  # sequence 1 claims more positions than the cache holds
        seqlens = torch.tensor([30, capacity + 5, 64], dtype=torch.int32)
    out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, check_inputs=False,
                                                **kwargs)
    assert out[1].isnan().all() and lse[1].isnan().all()
    assert torch.equal(out[0], checked[0][0]) and torch.equal(out[2], checked[0][2])
    with pytest.raises(attnforge.InvalidInputError, match="outside the cache|between 0 and"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_a_batch_whose_sequences_all_have_no_keys_is_served(backend, with_sinks, gen, poisoned_empty):
    """Every cache_seqlens 0 (a fresh batch before its first append): the kernel still runs, each row 0 and its LSE
    -inf, or with sinks the sink's logit (what a row that sees no key gets)."""
    k_cache, v_cache = filled(gen, [0, 0], 64, 2)
    q = torch.randn(2, 3, 4, D, generator=gen).half()
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                                causal=True, sinks=sinks, return_lse=True, backend=backend)
    assert attnforge.last_decision().forward.backend == backend
    assert torch.equal(out, torch.zeros_like(out))
    no_key = torch.full_like(lse, -math.inf) if sinks is None else sinks[None, :, None].expand_as(lse)
    # (the sink's logit goes through log2 units in the kernel: within a few fp32 roundings)
    assert_close("lse", lse, no_key.double(), no_key, ulps=4)

"""The KV-cache kernel on an NVIDIA GPU, through attention_with_kvcache in bf16 and fp16, against fp64 math per
sequence: every head dim its table declares, contiguous and paged caches (pages of 16, 64 and 256, shuffled,
with a random block table), lengths 0, 1, 17, 1023 and 4099, appends, decode and chunked prefill, GQA, the split
heuristic and forced splits, causal, windows, softcap and sinks. Unowned cache positions are NaN and outputs
NaN-filled before the run (poisoned_empty)."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.backends.triton_fa2 import variants
from attnforge.testing import assert_close, oracle, peer_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

LENGTHS = [0, 1, 17, 1023, 4099]
# the table's head dims, and some between them (variants.KV_HEAD_DIMS: the next entry's tile, columns masked)
HEAD_DIMS = sorted({*variants.KVCACHE["sm90"], 16, 40, 80, 200})


def cache_pair(gen, lengths, capacity, heads_kv, d, dtype):
    k_cache, v_cache = (torch.full((len(lengths), capacity, heads_kv, d), float("nan"), dtype=dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        for c in (k_cache, v_cache):
            c[b, :n] = torch.randn(n, heads_kv, d, generator=gen).to(dtype)
    return k_cache.cuda(), v_cache.cuda()


def to_pages(cache, table, page_size, pool):
    pages = torch.full((pool, page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype, device=cache.device)
    per_seq = table.shape[1]
    pages[table.long()] = cache.reshape(cache.shape[0], per_seq, page_size, *cache.shape[2:])
    return pages


# (heads_q, heads_kv, seqlen_q, seqlen_new, causal, window, softcap, sinks, num_splits)
CASES = [(32, 8, 1, 0, False, (-1, -1), 0.0, False, 0), (32, 8, 1, 1, True, (-1, -1), 0.0, False, 7),
         (8, 8, 113, 113, True, (-1, -1), 0.0, False, 0), (16, 2, 4, 4, True, (256, -1), 30.0, True, 0)]


# every head dim contiguous and with pages of 64; pages of 16 and 256 at d=128 (the page lookup does not depend on d)
LAYOUTS = [(d, p) for d in HEAD_DIMS for p in ((0, 16, 64, 256) if d == 128 else (0, 64))]


def run_case(gen, heads, seqlen_q, new, head_dim, page_size, dtype, **kwargs):
    """attention_with_kvcache on LENGTHS cached tokens per sequence plus ``new`` appended, in a contiguous cache or pages
    of ``page_size`` (a shuffled pool, a random block table); ``heads`` (q's, kv's); ``kwargs`` the call's (sinks=True:
    random sink logits). Returns (out, lse, q, the dense caches with the appends, sinks)."""
    hq, hkv = heads
    batch, capacity = len(LENGTHS), 4352  # 17 pages of 256, 68 of 64, 272 of 16
    k_cache, v_cache = cache_pair(gen, LENGTHS, capacity, hkv, head_dim, dtype)
    q = torch.randn(batch, seqlen_q, hq, head_dim, generator=gen).to("cuda", dtype)
    k_new, v_new = ((torch.randn(batch, new, hkv, head_dim, generator=gen).to("cuda", dtype) for _ in range(2))
                    if new else (None, None))
    sinks = (torch.randn(hq, generator=gen) * 2).cuda() if kwargs.pop("sinks") else None
    dense_k, dense_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(LENGTHS):
        if new:
            dense_k[b, n:n + new], dense_v[b, n:n + new] = k_new[b], v_new[b]
    kwargs = dict(cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32, device="cuda"), sinks=sinks, return_lse=True,
                  **kwargs)
    if page_size:
        per_seq = capacity // page_size
        pool = batch * per_seq + 3
        table = torch.randperm(pool, generator=gen)[:batch * per_seq].to(torch.int32).reshape(batch, per_seq).cuda()
        k_pages, v_pages = to_pages(k_cache, table, page_size, pool), to_pages(v_cache, table, page_size, pool)
        out, lse = attnforge.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, block_table=table, **kwargs)
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    return out, lse, q, (dense_k, dense_v), sinks


def check_sequences(out, lse, q, dense, new, mask, softcap, sinks):
    """run_case's output and LSE against fp64 math on each sequence's keys (a sequence with none: output 0)."""
    head_dim = q.shape[3]
    scale = head_dim ** -0.5
    for b, n in enumerate(LENGTHS):
        end = n + new
        if end == 0:
            assert (out[b] == 0).all()
            continue
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], dense[0][b, :end], dense[1][b, :end])]
        ref, ref_lse, _ = oracle(*bhsd, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
        peer, _ = peer_error(*bhsd, mask=mask, scale=scale, softcap=softcap, sinks=sinks)
        ulps = 4 * math.sqrt(max(end, head_dim))
        assert_close(f"out[{b}]", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,page_size", LAYOUTS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_on_the_gpu(case, head_dim, page_size, dtype, gen, poisoned_empty):
    hq, hkv, nq, new, causal, window, cap, with_sinks, splits = case
    out, lse, q, dense, sinks = run_case(gen, (hq, hkv), nq, new, head_dim, page_size, dtype, causal=causal,
                                         window_size=window, softcap=cap, sinks=with_sinks, num_splits=splits,
                                         backend="triton_fa2")
    check_sequences(out, lse, q, dense, new, _causal_mask(causal, window), cap, sinks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [0, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("case", [(32, 8, 1, 1, True, 0), (8, 8, 113, 0, True, 0), (16, 2, 4, 4, False, 5)], ids=str)
def test_fp8_kvcache_on_the_gpu(case, page_size, dtype, gen, poisoned_empty):
    """An e4m3 cache (values near 4, NaN where no sequence owns a position) with per-(sequence, KV head) descales,
    against fp64 math on the values it stands for: the FP8_KV kernel, contiguous and paged, decode with an append
    and chunked prefill, forced splits."""
    hq, hkv, nq, new, causal, splits = case
    head_dim, batch, capacity = 128, len(LENGTHS), 4352
    e4m3 = torch.float8_e4m3fn
    k_cache, v_cache = ((c.float() * 4).to(e4m3) for c in cache_pair(gen, LENGTHS, capacity, hkv, head_dim, dtype))
    k_descale, v_descale = ((torch.rand(batch, hkv, generator=gen) + 0.25).cuda() for _ in range(2))
    q = torch.randn(batch, nq, hq, head_dim, generator=gen).to("cuda", dtype)
    k_new, v_new = ((torch.randn(batch, new, hkv, head_dim, generator=gen).mul(4).to("cuda", e4m3) for _ in range(2))
                    if new else (None, None))
    dense_k, dense_v = k_cache.float(), v_cache.float()
    for b, n in enumerate(LENGTHS):
        if new:
            dense_k[b, n:n + new], dense_v[b, n:n + new] = k_new[b].float(), v_new[b].float()
    kwargs = dict(cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32, device="cuda"), causal=causal,
                  num_splits=splits, return_lse=True, backend="triton_fa2", k_descale=k_descale, v_descale=v_descale)
    if page_size:
        per_seq = capacity // page_size
        pool = batch * per_seq + 3
        table = torch.randperm(pool, generator=gen)[:batch * per_seq].to(torch.int32).reshape(batch, per_seq).cuda()
        pages = [to_pages(c.float(), table, page_size, pool).to(e4m3) for c in (k_cache, v_cache)]
        out, lse = attnforge.attention_with_kvcache(q, *pages, k_new, v_new, block_table=table, **kwargs)
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert attnforge.last_decision().forward.variant.fp8_kv and out.dtype == dtype
    mask = _causal_mask(causal)
    scale = head_dim ** -0.5
    for b, n in enumerate(LENGTHS):
        end = n + new
        if end == 0:
            assert (out[b] == 0).all()
            continue
        keys = dense_k[b, :end] * k_descale[b][None, :, None]
        values = dense_v[b, :end] * v_descale[b][None, :, None]
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], keys, values)]
        ref, ref_lse, _ = oracle(*bhsd, mask=mask, scale=scale)
        peer, _ = peer_error(*(t.to(dtype) for t in bhsd), mask=mask, scale=scale)
        ulps = 4 * math.sqrt(max(end, head_dim))
        assert_close(f"out[{b}]", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("page_size", [0, 64], ids=lambda p: f"page{p}" if p else "contiguous")
def test_compiled_decode_steps_match_eager_on_the_gpu(page_size, gen):
    """Two decode steps (append one token, attend; GQA 32/8, d=128, bf16) under torch.compile(fullgraph=True,
    inductor): the custom op runs triton_fa2's kernel, and outputs, LSEs and caches are bitwise eager's."""
    lengths, d = [1023, 0, 17], 128
    k_cache, v_cache = cache_pair(gen, lengths, 1280, 8, d, torch.bfloat16)
    table = None
    if page_size:
        per_seq = 1280 // page_size
        pool = len(lengths) * per_seq + 3
        table = torch.randperm(pool, generator=gen)[:len(lengths) * per_seq].to(torch.int32).view(len(lengths), -1)
        k_cache, v_cache = (to_pages(c, table.cuda(), page_size, pool) for c in (k_cache, v_cache))
        table = table.cuda()
    q = torch.randn(len(lengths), 1, 32, d, generator=gen).to("cuda", torch.bfloat16)
    k_new, v_new = (torch.randn(len(lengths), 1, 8, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step(q, k_cache, v_cache, k_new, v_new, seqlens, table):
        return attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                block_table=table, causal=True, return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    eager_caches = k_cache.clone(), v_cache.clone()
    for _ in range(2):
        want = step(q, *eager_caches, k_new, v_new, seqlens, table)
        got = compiled(q, k_cache, v_cache, k_new, v_new, seqlens, table)
        assert attnforge.last_decision().forward.backend == "triton_fa2"
        assert got[0].isfinite().all()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(k_cache.nan_to_num(7.0), eager_caches[0].nan_to_num(7.0))
        assert torch.equal(v_cache.nan_to_num(7.0), eager_caches[1].nan_to_num(7.0))
        seqlens += 1

"""An fp8 (e4m3) KV cache in the KV-cache kernel (FP8_KV) in Triton's interpreter: fp16 queries against e4m3 keys
and values with per-(sequence, KV head) descales, through attention_with_kvcache, against fp64 math on the values
the cache stands for (cache * descale): contiguous and paged caches, appends in e4m3, decode and chunked prefill,
GQA, splits, causal, softcap and sinks. Unowned cache positions are NaN and outputs NaN-filled (poisoned_empty).
Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

import attnforge  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, oracle, peer_error  # noqa: E402

from .test_kvcache import LENGTHS, as_pages, random_table  # noqa: E402

D = 32
E4M3 = torch.float8_e4m3fn

# (heads_q, heads_kv, seqlen_q, seqlen_new, causal, softcap, sinks, num_splits)
CASES = [(8, 2, 1, 0, False, 0.0, False, 0), (8, 2, 1, 1, True, 0.0, False, 3), (2, 2, 5, 5, True, 0.0, False, 1),
         (4, 2, 2, 0, False, 5.0, True, 4)]


def fp8_caches(gen, lengths, capacity, heads_kv):
    """Contiguous (B, capacity, heads_kv, D) e4m3 caches: ``lengths`` random tokens each (values near 4, where e4m3
    rounds by 1/4: what quantisation leaves), NaN past them."""
    caches = [torch.full((len(lengths), capacity, heads_kv, D), float("nan")) for _ in range(2)]
    for b, n in enumerate(lengths):
        for cache in caches:
            cache[b, :n] = torch.randn(n, heads_kv, D, generator=gen) * 4
    return tuple(c.to(E4M3) for c in caches)


@pytest.mark.parametrize("backend", ["triton_fa2", "reference"])
@pytest.mark.parametrize("page_size", [0, 16, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_cache_against_fp64_on_the_dequantised_values(backend, page_size, case, gen, poisoned_empty):
    hq, hkv, nq, new, causal, cap, with_sinks, splits = case
    batch, capacity = len(LENGTHS), 192
    k_cache, v_cache = fp8_caches(gen, LENGTHS, capacity, hkv)
    k_descale, v_descale = (torch.rand(batch, hkv, generator=gen) + 0.25 for _ in range(2))
    q = torch.randn(batch, nq, hq, D, generator=gen).half()
    k_new, v_new = ((torch.randn(batch, new, hkv, D, generator=gen).mul(4).to(E4M3) for _ in range(2)) if new
                    else (None, None))
    sinks = torch.randn(hq, generator=gen) * 2.0 if with_sinks else None
    kwargs = dict(cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32), causal=causal, softcap=cap, sinks=sinks,
                  num_splits=splits, scale=0.3, return_lse=True, backend=backend, k_descale=k_descale,
                  v_descale=v_descale)
    dense_k, dense_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(LENGTHS):
        if new:
            dense_k[b, n:n + new], dense_v[b, n:n + new] = k_new[b], v_new[b]
    if page_size:
        per_seq = capacity // page_size
        pool = batch * per_seq + 5
        table = random_table(gen, batch, per_seq, pool)
        pages = [as_pages(c.float(), table, page_size, pool).to(E4M3) for c in (k_cache, v_cache)]  # (exact)
        out, lse = attnforge.attention_with_kvcache(q, *pages, k_new, v_new, block_table=table, **kwargs)
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    decision = attnforge.last_decision()
    assert decision.problem.kv_dtype == "fp8" and "fp8 kv cache" in decision.problem.describe()
    if backend == "triton_fa2":
        assert decision.forward.variant.fp8_kv
    assert out.dtype == torch.float16 and not out.isnan().any()
    mask = _causal_mask(causal)
    ulps = 4 * math.sqrt(max(LENGTHS[-1] + new, D))
    for b, n in enumerate(LENGTHS):
        end = n + new
        if end == 0:
            assert (out[b] == 0).all()
            continue
        keys, values = (c[b, :end].float() * d[b][None, :, None] for c, d in ((dense_k, k_descale),
                                                                              (dense_v, v_descale)))
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[b], keys, values)]
        ref, ref_lse, _ = oracle(*bhsd, mask=mask, scale=0.3, softcap=cap, sinks=sinks)
        peer, _ = peer_error(*(t.half() for t in bhsd), mask=mask, scale=0.3, softcap=cap, sinks=sinks)
        assert_close(f"out[{b}]", out[b].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[b:b + 1], ref_lse, ref_lse.float(), ulps=ulps)


def test_fp8_cache_inputs_are_checked(gen):
    k_cache, v_cache = fp8_caches(gen, [3, 5], 8, 2)
    q = torch.randn(2, 1, 4, D, generator=gen).half()
    with pytest.raises(attnforge.InvalidInputError, match=r"k_descale must be a float tensor of shape \(batch, "
                                                          r"heads_kv\) = \(2, 2\)"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, k_descale=torch.ones(2))
    with pytest.raises(attnforge.InvalidInputError, match="new k, v are float8_e4m3fn too"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, torch.zeros(2, 1, 2, D).half(),
                                         torch.zeros(2, 1, 2, D).half(), cache_seqlens=3)
    with pytest.raises(attnforge.InvalidInputError, match="fp16 or bf16 queries"):
        attnforge.attention_with_kvcache(q.float(), k_cache, v_cache, cache_seqlens=3)
    with pytest.raises(attnforge.InvalidInputError, match="apply to a float8_e4m3fn cache"):
        attnforge.attention_with_kvcache(q, k_cache.half(), v_cache.half(), cache_seqlens=3, v_descale=torch.ones(2, 2))

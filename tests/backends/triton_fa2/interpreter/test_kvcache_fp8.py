"""An fp8 KV cache in the KV-cache kernel (FP8_KV) in Triton's interpreter: fp16 queries against e4m3 (or e4m3fnuz)
keys and values with per-(sequence, KV head) descales, through attention_with_kvcache, against fp64 math on the
values the cache stands for (cache * descale): contiguous and paged caches, appends in fp8, decode and chunked
prefill, GQA, splits, causal, softcap and sinks, for every backend and every cache format it declares
(Support.kv_cache_dtypes). Unowned cache positions are NaN and outputs NaN-filled (poisoned_empty). Runs with
TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

import attnforge  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.dispatch import registered  # noqa: E402
from attnforge.dispatch.problem import KV_CACHE_DTYPES  # noqa: E402
from attnforge.testing import assert_close, oracle, peer_error  # noqa: E402

from .test_kvcache import LENGTHS, as_pages, random_table  # noqa: E402

D = 32
E4M3 = torch.float8_e4m3fn
# (backend, cache format) for every format a backend that serves KV caches on the CPU declares
SERVED = [(name, kv_dtype) for name in ("triton_fa2", "triton_rocm", "reference")
          for kv_dtype in sorted(registered()[name].support.kv_cache_dtypes)]

# (heads_q, heads_kv, seqlen_q, seqlen_new, causal, softcap, sinks, num_splits)
CASES = [(8, 2, 1, 0, False, 0.0, False, 0), (8, 2, 1, 1, True, 0.0, False, 3), (2, 2, 5, 5, True, 0.0, False, 1),
         (4, 2, 2, 0, False, 5.0, True, 4)]


def fp8_caches(gen, lengths, capacity, heads_kv, fp8=E4M3):
    """Contiguous (B, capacity, heads_kv, D) caches in ``fp8``: ``lengths`` random tokens each (values near 4, where
    e4m3 rounds by 1/4: what quantisation leaves), NaN past them."""
    caches = [torch.full((len(lengths), capacity, heads_kv, D), float("nan")) for _ in range(2)]
    for b, n in enumerate(lengths):
        for cache in caches:
            cache[b, :n] = torch.randn(n, heads_kv, D, generator=gen) * 4
    return tuple(c.to(fp8) for c in caches)


def test_every_fp8_format_is_served_somewhere_on_the_cpu():
    assert {kv_dtype for _, kv_dtype in SERVED} == set(KV_CACHE_DTYPES)
    assert ("triton_rocm", "fp8_fnuz") in SERVED and ("triton_fa2", "fp8") in SERVED


@pytest.mark.parametrize("backend,kv_dtype", SERVED, ids="-".join)
@pytest.mark.parametrize("page_size", [0, 16, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_cache_against_fp64_on_the_dequantised_values(backend, kv_dtype, page_size, case, gen, poisoned_empty):
    hq, hkv, nq, new, causal, cap, with_sinks, splits = case
    fp8 = KV_CACHE_DTYPES[kv_dtype]
    batch, capacity = len(LENGTHS), 192
    k_cache, v_cache = fp8_caches(gen, LENGTHS, capacity, hkv, fp8)
    k_descale, v_descale = (torch.rand(batch, hkv, generator=gen) + 0.25 for _ in range(2))
    q = torch.randn(batch, nq, hq, D, generator=gen).half()
    k_new, v_new = ((torch.randn(batch, new, hkv, D, generator=gen).mul(4).to(fp8) for _ in range(2)) if new
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
        pages = [as_pages(c.float(), table, page_size, pool).to(fp8) for c in (k_cache, v_cache)]  # (exact)
        out, lse = attnforge.attention_with_kvcache(q, *pages, k_new, v_new, block_table=table, **kwargs)
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    decision = attnforge.last_decision()
    assert decision.problem.kv_dtype == kv_dtype and f"{kv_dtype} kv cache" in decision.problem.describe()
    assert decision.forward.backend == backend
    if backend != "reference":
        assert decision.forward.variant.kv_dtype == kv_dtype
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
    with pytest.raises(attnforge.InvalidInputError, match="new k, v are torch.float8_e4m3fn too"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, torch.zeros(2, 1, 2, D).half(),
                                         torch.zeros(2, 1, 2, D).half(), cache_seqlens=3)
    with pytest.raises(attnforge.InvalidInputError, match="fp16 or bf16 queries"):
        attnforge.attention_with_kvcache(q.float(), k_cache, v_cache, cache_seqlens=3)
    with pytest.raises(attnforge.InvalidInputError, match="apply to a float8_e4m3fn or float8_e4m3fnuz cache"):
        attnforge.attention_with_kvcache(q, k_cache.half(), v_cache.half(), cache_seqlens=3, v_descale=torch.ones(2, 2))


def test_fp8_formats_do_not_mix_and_a_backend_without_one_says_so(gen):
    k_cache, v_cache = fp8_caches(gen, [3, 5], 8, 2, torch.float8_e4m3fnuz)
    q = torch.randn(2, 1, 4, D, generator=gen).half()
    with pytest.raises(attnforge.InvalidInputError, match="v_cache is torch.float8_e4m3fn: with a "
                                                          "torch.float8_e4m3fnuz k_cache"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache.float().to(E4M3), cache_seqlens=3)
    with pytest.raises(attnforge.BackendUnavailableError, match=r"an fp8 \(e4m3fnuz\) KV cache is not supported"):
        attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, backend="triton_fa2")
    decision = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=1, seqlen_k=4096, heads=32,
                                 kv_heads=8, kv_cache="contiguous", kv_dtype="fp8_fnuz")
    assert decision.forward.backend == "reference"  # NVIDIA has no e4m3fnuz conversion; reference dequantises
    on_mi300 = attnforge.explain(device="MI300X", dtype="bf16", head_dim=128, seqlen_q=1, seqlen_k=4096, heads=32,
                                 kv_heads=8, kv_cache="contiguous", kv_dtype="fp8_fnuz")
    assert on_mi300.forward.backend == "triton_rocm" and on_mi300.forward.variant.kv_dtype == "fp8_fnuz"
    ocp_on_mi300 = attnforge.explain(device="MI300X", dtype="bf16", head_dim=128, seqlen_q=1, seqlen_k=4096,
                                     heads=32, kv_heads=8, kv_cache="contiguous", kv_dtype="fp8")
    assert ocp_on_mi300.forward.backend != "triton_rocm"
    assert any("needs its conversion in hardware (gfx950; the device is gfx942)" in r
               for r in ocp_on_mi300.forward.reasons_of("triton_rocm"))

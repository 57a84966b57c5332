"""integrations.flash_attn: flash-attn 2.8's functions over attnforge. Their signatures are flash-attn's (names,
order, defaults: code calls them positionally); each parameter reaches the call it names, checked against fp64
math on odd lengths (causal bottom-right, windows, softcap, ALiBi, GQA, the LSE, gradients through packed
tensors); what is not served is refused with the reason."""

import inspect
import math
import re

import pytest
import torch

from attnforge import InvalidInputError
from attnforge.api import _causal_mask
from attnforge.integrations import flash_attn as fa
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error

# flash-attn 2.8.3's flash_attn/flash_attn_interface.py: each function's parameters and defaults, in order
COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
          ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
REQUIRED = object()
SIGNATURES = {
    "flash_attn_func": [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), *COMMON],
    "flash_attn_qkvpacked_func": [("qkv", REQUIRED), *COMMON],
    "flash_attn_kvpacked_func": [("q", REQUIRED), ("kv", REQUIRED), *COMMON],
    "flash_attn_varlen_func": [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED),
                               ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED),
                               *COMMON, ("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", REQUIRED), ("cu_seqlens", REQUIRED), ("max_seqlen", REQUIRED),
                                         *COMMON],
    "flash_attn_varlen_kvpacked_func": [("q", REQUIRED), ("kv", REQUIRED), ("cu_seqlens_q", REQUIRED),
                                        ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED),
                                        ("max_seqlen_k", REQUIRED), *COMMON],
    "flash_attn_with_kvcache": [("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", None),
                                ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}
FEATURES = [dict(), dict(causal=True), dict(window_size=(3, 2)), dict(causal=True, window_size=[4, -1]),
            dict(softcap=2.0), dict(alibi=True)]
ULPS = 4 * math.sqrt(113)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attns(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    got = [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def _features(feature, gen, heads):
    kw = {key: value for key, value in feature.items() if key != "alibi"}
    slopes = torch.rand(heads, generator=gen) if feature.get("alibi") else None
    return kw, slopes


def _mask(feature):
    return _causal_mask(feature.get("causal", False), tuple(feature.get("window_size", (-1, -1))))


def _bhsd(tensors):
    return [t.transpose(1, 2) for t in tensors]


def _expected(q, k, v, feature, slopes, dout):
    """fp64 math for bshd q, k, v: out (bshd), lse (batch, heads, seqlen_q), PyTorch's own out in the inputs' dtype
    (bshd), and the gradients of fp64 math and of PyTorch's (bhsd, as testing.assert_grads_close takes them)."""
    bhsd = _bhsd((q, k, v, dout))
    kw = dict(mask=_mask(feature), scale=0.3, softcap=feature.get("softcap", 0.0), alibi_slopes=slopes, dout=bhsd[3])
    ref, ref_lse, ref_grads = oracle(*bhsd[:3], **kw)
    peer, peer_grads = peer_error(*bhsd[:3], **kw)
    return ref.transpose(1, 2), ref_lse, peer.transpose(1, 2), ref_grads, peer_grads


@pytest.mark.parametrize("feature", FEATURES, ids=str)
@pytest.mark.parametrize("packing", ["separate", "kv", "qkv"])
def test_dense_functions_match_fp64_math(feature, packing, gen):
    kw, slopes = _features(feature, gen, heads=4)
    seqlen_k, heads_kv = (17, 4) if packing == "qkv" else (23, 2)  # qkv packs one length and head count
    q = torch.randn(2, 17, 4, 16, generator=gen)
    k, v = (torch.randn(2, seqlen_k, heads_kv, 16, generator=gen) for _ in range(2))
    args = dict(dropout_p=0.0, softmax_scale=0.3, alibi_slopes=slopes, return_attn_probs=True, **kw)
    if packing == "qkv":
        leaves = (torch.stack([q, k, v], 2).requires_grad_(),)
        out, lse, probs = fa.flash_attn_qkvpacked_func(*leaves, **args)
    elif packing == "kv":
        leaves = (q.requires_grad_(), torch.stack([k, v], 2).requires_grad_())
        out, lse, probs = fa.flash_attn_kvpacked_func(*leaves, **args)
    else:
        leaves = tuple(t.requires_grad_() for t in (q, k, v))
        out, lse, probs = fa.flash_attn_func(*leaves, **args)
    assert probs is None and out.shape == q.shape and lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=gen)
    ref, ref_lse, peer, ref_grads, peer_grads = _expected(q.detach(), k, v, feature, slopes, dout)
    assert_close("out", out, ref, peer, ulps=ULPS)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ULPS)
    grads = torch.autograd.grad(out, leaves, dout)
    # the packed tensor's gradient is its parts' gradients stacked where the parts were
    unpacked = {"qkv": lambda g: g[0].unbind(2), "kv": lambda g: (g[0], *g[1].unbind(2)), "separate": lambda g: g}
    assert_grads_close(_bhsd(unpacked[packing](grads)), ref_grads, peer_grads,
                       *_bhsd((q.detach(), k.detach(), v.detach(), dout)), _mask(feature), 0.3, ulps=ULPS)


def _packed(gen, lengths_q, lengths_k, heads=4, heads_kv=2, dim=16):
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), heads_kv, dim, generator=gen).requires_grad_() for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("feature", FEATURES, ids=str)
def test_varlen_function_matches_fp64_math_per_sequence(feature, gen):
    lengths_q, lengths_k = [17, 1, 40], [23, 5, 40]
    kw, slopes = _features(feature, gen, heads=4)
    q, k, v, cu_q, cu_k = _packed(gen, lengths_q, lengths_k)
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, 0.0, 0.3, alibi_slopes=slopes,
                                                return_attn_probs=True, **kw)
    assert probs is None and out.shape == q.shape and lse.shape == (4, q.shape[0])
    for i in range(3):
        rows_q, rows_k = slice(*cu_q[i:i + 2].tolist()), slice(*cu_k[i:i + 2].tolist())
        one = [t[rows].unsqueeze(0) for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        ref, ref_lse, peer, _, _ = _expected(*one, feature, slopes, torch.zeros_like(one[0]))
        assert_close(f"out {i}", out[rows_q].unsqueeze(0), ref, peer, ulps=ULPS)
        assert_close(f"lse {i}", lse[:, rows_q].unsqueeze(0), ref_lse, ref_lse.float(), ulps=ULPS)


def test_varlen_packed_forms_give_the_separate_forms_results(gen):
    lengths = [17, 0, 33]
    q, k, v, cu, _ = _packed(gen, lengths, lengths, heads_kv=4)
    kw = dict(causal=True, softmax_scale=0.3, return_attn_probs=True)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, **kw)
    qkv = torch.stack([q, k, v], 1)
    packed_out, packed_lse, _ = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 33, **kw)
    kv_out, kv_lse, _ = fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 33, 33, **kw)
    for got, got_lse in ((packed_out, packed_lse), (kv_out, kv_lse)):
        assert torch.equal(got, out) and torch.equal(got_lse, lse)


# the KV-cache kernels run on a GPU in 16-bit (triton_fa2, cute_sm90); on the CPU reference serves fp32
DEVICES = [pytest.param("cpu", torch.float32, id="cpu"),
           pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])]


def _check_decode(out, lse, q, caches, lengths, feature):
    """Each sequence's output and LSE against fp64 math on its first ``lengths[b]`` cached keys and values."""
    for b, n in enumerate(lengths):
        one = [q[b:b + 1], caches[0][b:b + 1, :n], caches[1][b:b + 1, :n]]
        ref, ref_lse, peer, _, _ = _expected(*one, feature, None, torch.zeros_like(one[0]))
        assert_close(f"out {b}", out[b:b + 1].cpu(), ref, peer, ulps=ULPS)
        if lse is not None:
            assert_close(f"lse {b}", lse[b:b + 1].cpu(), ref_lse, ref_lse.float(), ulps=ULPS)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_function_matches_fp64_math(paged, device, dtype, gen):
    """Appends in place, decode against cached lengths 9 and 4, bottom-right causal, softcap, the LSE; a paged
    cache in pages of 4 in a shuffled pool."""
    batch, capacity, page = 2, 16, 4
    cache = [torch.randn(batch, capacity, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    q, new_k, new_v = (torch.randn(batch, *shape, 16, generator=gen).to(dtype) for shape in ((2, 4), (2, 2), (2, 2)))
    lengths = torch.tensor([9, 4], dtype=torch.int32)
    expected = [c.clone() for c in cache]
    for b, n in enumerate(lengths.tolist()):
        expected[0][b, n:n + 2], expected[1][b, n:n + 2] = new_k[b], new_v[b]
    block_table = None
    if paged:
        order = torch.randperm(batch * capacity // page, generator=gen)
        block_table = order.view(batch, -1).to(torch.int32).to(device)
        pools = [torch.empty(batch * capacity // page, page, 2, 16, dtype=dtype) for _ in range(2)]
        for pool, c in zip(pools, cache):
            pool[order] = c.reshape(-1, page, 2, 16)
        cache = pools
    cache = [c.to(device) for c in cache]
    out, lse = fa.flash_attn_with_kvcache(q.to(device), *cache, new_k.to(device), new_v.to(device),
                                         cache_seqlens=lengths.to(device), block_table=block_table,
                                         softmax_scale=0.3, causal=True, softcap=2.0, return_softmax_lse=True)
    cache = [c.cpu() for c in cache]
    if paged:
        cache = [pool[block_table.long().cpu()].reshape(batch, capacity, 2, 16) for pool in cache]
    assert all(torch.equal(c, e) for c, e in zip(cache, expected)), "appended keys and values not in place"
    _check_decode(out, lse, q, expected, (lengths + 2).tolist(), dict(causal=True, softcap=2.0))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_cache_batch_idx_picks_each_sequences_cache_row(device, dtype, gen):
    """Sequence b reads, and appends to, cache row cache_batch_idx[b]; the other rows are untouched."""
    k_cache, v_cache = (torch.randn(4, 16, 2, 16, generator=gen).to(dtype) for _ in range(2))
    q, new_k, new_v = (torch.randn(2, 1, heads, 16, generator=gen).to(dtype) for heads in (4, 2, 2))
    rows, lengths = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([9, 4], dtype=torch.int32)
    expected = [c.clone() for c in (k_cache, v_cache)]
    for b, (row, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
        expected[0][row, n], expected[1][row, n] = new_k[b, 0], new_v[b, 0]
    caches = [c.to(device) for c in (k_cache, v_cache)]
    out = fa.flash_attn_with_kvcache(q.to(device), *caches, new_k.to(device), new_v.to(device),
                                     cache_seqlens=lengths.to(device), cache_batch_idx=rows.to(device), causal=True,
                                     softmax_scale=0.3)
    assert all(torch.equal(c.cpu(), e) for c, e in zip(caches, expected)), "not appended to exactly those rows"
    by_row = [e[rows.long()] for e in expected]
    _check_decode(out, None, q, by_row, (lengths + 1).tolist(), dict(causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("layout", ["contiguous", "cache_batch_idx"])
def test_kvcache_function_is_captured_in_a_cuda_graph(layout, gen, monkeypatch):
    """While a CUDA graph is captured nothing is read on the host (flash-attn's call is capturable): the replay
    appends in place and attends, against fp64 math, with the lengths the replay finds."""
    k_cache, v_cache = (torch.randn(3, 64, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    q, new_k, new_v = (torch.randn(2, 1, heads, 16, generator=gen).to(torch.bfloat16) for heads in (4, 2, 2))
    rows = [2, 0] if layout == "cache_batch_idx" else [0, 1]
    caches = [c.to("cuda") for c in (k_cache, v_cache)]
    lengths = torch.tensor([9, 4], dtype=torch.int32, device="cuda")
    batch_idx = torch.tensor(rows, dtype=torch.int32, device="cuda") if layout == "cache_batch_idx" else None

    def step(kv):
        return fa.flash_attn_with_kvcache(q.cuda(), *kv, new_k.cuda(), new_v.cuda(), cache_seqlens=lengths,
                                         cache_batch_idx=batch_idx, softmax_scale=0.3, causal=True)

    with monkeypatch.context() as patch:  # the captured form, compiled and warmed up outside the capture
        patch.setattr(fa, "_capturing", lambda q: True)
        step([c.clone() for c in caches])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(caches)
    lengths.copy_(torch.tensor([30, 17], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    expected = [c.clone() for c in (k_cache, v_cache)]
    for b, (row, n) in enumerate(zip(rows, (30, 17))):
        expected[0][row, n], expected[1][row, n] = new_k[b, 0], new_v[b, 0]
    assert all(torch.equal(c.cpu(), e) for c, e in zip(caches, expected)), "the replay did not append in place"
    _check_decode(out, None, q, [e[rows] for e in expected], [31, 18], dict(causal=True))


@pytest.mark.parametrize("call,words", [
    (lambda q, c, cu, idx: fa.flash_attn_with_kvcache(q, c, c, rotary_cos=torch.ones(16, 8),
                                                      rotary_sin=torch.zeros(16, 8)), "rotary"),
    (lambda q, c, cu, idx: fa.flash_attn_with_kvcache(q, c, c, alibi_slopes=torch.ones(4)), "ALiBi"),
    (lambda q, c, cu, idx: fa.flash_attn_with_kvcache(q, c, c, cache_batch_idx=idx.long()), "cache_batch_idx"),
    (lambda q, c, cu, idx: fa.flash_attn_with_kvcache(q, c, c, cache_batch_idx=idx,
                                                      block_table=idx.unsqueeze(1)), "block_table"),
    (lambda q, c, cu, idx: fa.flash_attn_with_kvcache(q, c, c, cache_batch_idx=idx + 1),
     re.escape("cache_batch_idx names rows outside the cache's 2: [2]")),
    (lambda q, c, cu, idx: fa.flash_attn_varlen_func(q[0], c[0], c[0], cu, cu, 1, 1, dropout_p=0.1), "dropout"),
    (lambda q, c, cu, idx: fa.flash_attn_varlen_func(q[0], c[0], c[0], cu, cu, 1, 1,
                                                     block_table=idx.unsqueeze(1)), "paged"),
    (lambda q, c, cu, idx: fa.flash_attn_qkvpacked_func(q), re.escape("qkv must be a (batch, seqlen, 3, heads, head_dim)")),
    (lambda q, c, cu, idx: fa.flash_attn_varlen_kvpacked_func(q[0], c[0], cu, cu, 1, 1),
     re.escape("kv must be a (total, 2, heads, head_dim)")),
])
def test_what_is_not_served_is_refused_with_the_reason(call, words):
    q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 16, 2, 16)
    with pytest.raises(InvalidInputError, match=words):
        call(q, cache, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))

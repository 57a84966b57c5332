"""Random attention() calls on triton_fa2 in Triton's interpreter, forward and backward, against fp64 math: each seed
draws a combination the feature tests take one at a time (layout and strides of each input, GQA, odd and unequal
lengths, causal, a window, softcap, sinks, ALiBi, the scale's sign, gradients), so that their interactions are
checked too; likewise attention_with_kvcache and attention_varlen calls (the latter on either Triton backend). fp16
(the interpreter's bf16 dot is not exact: docs/kernel-notes.md, section 6); outputs NaN-filled before the run
(poisoned_empty). Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

import attnforge  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.errors import BackendUnavailableError  # noqa: E402
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error  # noqa: E402

SEEDS = range(160)  # (400 seeds passed when this was written; 160 keep the suite under a minute)
LAYOUTS = ("contiguous", "sliced", "permuted")


def tensor(shape, layout: str, rnd: random.Random, gen) -> torch.Tensor:
    """A (batch, seqlen, heads, dim) fp16 tensor laid out as ``layout`` says: dense, a strided slice of a larger
    one, or a permuted copy (heads outermost, seqlen innermost but one)."""
    b, s, h, d = shape
    if layout == "sliced":
        return torch.randn(b, s + 3, h + 1, d + 8, generator=gen).half()[:, 2:2 + s, :h, 4:4 + d]
    if layout == "permuted":
        return torch.randn(h, b, d, s, generator=gen).half().permute(1, 3, 0, 2)
    return torch.randn(b, s, h, d, generator=gen).half()


def draw(seed: int) -> dict:
    rnd = random.Random(seed)
    heads_kv = rnd.choice((1, 2))
    seqlen_q = rnd.choice((1, 3, 17, 70))
    return dict(batch=rnd.choice((1, 2)), heads_kv=heads_kv, heads_q=heads_kv * rnd.choice((1, 2, 3)),
                head_dim=rnd.choice((32, 64)), seqlen_q=seqlen_q,
                seqlen_k=seqlen_q if rnd.random() < 0.4 else rnd.choice((1, 5, 17, 90)),
                layouts=[rnd.choice(LAYOUTS) for _ in range(3)], bhsd=rnd.random() < 0.5, causal=rnd.random() < 0.5,
                window=(rnd.choice((-1, 0, 3, 20)), rnd.choice((-1, 0, 5))) if rnd.random() < 0.3 else (-1, -1),
                softcap=rnd.choice((0.0, 0.0, 5.0)), sinks=rnd.random() < 0.25, alibi=rnd.random() < 0.2,
                scale=rnd.choice((None, None, 0.3, -0.2)), grad=rnd.random() < 0.6)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_call_matches_fp64_math(seed, poisoned_empty):
    c = draw(seed)
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed + 1)
    b, hq, hkv, d, nq, nk = (c[k] for k in ("batch", "heads_q", "heads_kv", "head_dim", "seqlen_q", "seqlen_k"))
    q, k, v = (tensor(shape, layout, rnd, gen) for shape, layout in
               zip(((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d)), c["layouts"]))
    if c["bhsd"]:  # (the same strides seen the other way round)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.detach().requires_grad_(c["grad"]) for t in (q, k, v))
    sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_(c["grad"]) if c["sinks"] else None
    slopes = torch.rand(hq, generator=gen) * 0.5 if c["alibi"] else None
    features = dict(softcap=c["softcap"], sinks=sinks, alibi_slopes=slopes)
    out, lse = attnforge.attention(q, k, v, causal=c["causal"], window_size=c["window"], scale=c["scale"],
                                   layout="bhsd" if c["bhsd"] else "bshd", return_lse=True, backend="triton_fa2",
                                   **features)
    assert attnforge.last_decision().forward.backend == "triton_fa2", c
    as_bhsd = (lambda t: t) if c["bhsd"] else (lambda t: t.transpose(1, 2))
    inputs = [as_bhsd(t).detach() for t in (q, k, v)]
    dout = torch.randn(inputs[0].shape, generator=gen).half() if c["grad"] else None
    mask = _causal_mask(c["causal"], c["window"])
    ref, ref_lse, ref_grads = oracle(*inputs, mask=mask, scale=c["scale"], dout=dout, **features)
    peer, peer_grads = peer_error(*inputs, mask=mask, scale=c["scale"], dout=dout, **features)
    ulps = 4 * math.sqrt(max(nk, d))
    assert_close(f"out {c}", as_bhsd(out), ref, peer, ulps=ulps)
    assert_close(f"lse {c}", lse, ref_lse, ref_lse.float(), ulps=ulps)
    if not c["grad"]:
        return
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(as_bhsd(out), leaves, dout)
    scale = abs(c["scale"]) if c["scale"] is not None else d ** -0.5
    # the tests' rule for gradients (rows that see exactly one key are pure cancellation: testing.assert_grads_close)
    assert_grads_close([as_bhsd(g) for g in grads[:3]], ref_grads[:3], peer_grads[:3], *inputs, dout, mask, scale,
                       8 * math.sqrt(max(nq, nk, d)))
    if sinks is not None:  # dsinks as its formula in fp64 on this call's own O and LSE (test_sinks.py says why)
        share = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())
        want = -(share * (dout.double() * as_bhsd(out).detach().double()).sum(-1)).sum((0, 2))
        assert_close(f"dsinks {c}", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * nq))


def draw_kvcache(seed: int) -> dict:
    rnd = random.Random(seed)
    heads_kv = rnd.choice((1, 2))
    capacity = rnd.choice((16, 33, 80, 130))
    new = rnd.choice((0, 0, 1, 3))
    lengths = [rnd.randint(0, capacity - new) for _ in range(rnd.choice((1, 2, 3)))]
    return dict(heads_kv=heads_kv, heads_q=heads_kv * rnd.choice((1, 2, 3)), seqlen_q=rnd.choice((1, 1, 2, 5, 17)),
                new=new, capacity=capacity, lengths=lengths, page_size=rnd.choice((0, 16, 32, 64)),
                leftpad=[rnd.randint(0, n) for n in lengths] if rnd.random() < 0.3 else None,
                causal=rnd.random() < 0.5,
                window=(rnd.choice((-1, 0, 3, 20)), rnd.choice((-1, 0, 5))) if rnd.random() < 0.3 else (-1, -1),
                softcap=rnd.choice((0.0, 0.0, 5.0, 30.0)), sinks=rnd.random() < 0.3,
                num_splits=rnd.choice((0, 0, 1, 2, 3, 7)), scale=rnd.choice((None, 0.3)))


@pytest.mark.parametrize("seed", range(96))
def test_a_random_kvcache_call_matches_fp64_math(seed, poisoned_empty):
    """attention_with_kvcache with a random draw of the same kind (test_kvcache.py's helpers: NaN wherever no
    sequence owns a cache position, pages shuffled in a pool): appends, left pads, page sizes, splits."""
    from .test_kvcache import D, as_pages, check, expected, filled, random_table

    c = draw_kvcache(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths, new, capacity, hq, hkv = c["lengths"], c["new"], c["capacity"], c["heads_q"], c["heads_kv"]
    batch = len(lengths)
    k_cache, v_cache = filled(gen, lengths, capacity, hkv)
    q = torch.randn(batch, c["seqlen_q"], hq, D, generator=gen).half()
    k_new, v_new = ((torch.randn(batch, new, hkv, D, generator=gen).half() for _ in range(2)) if new else (None, None))
    sinks = torch.randn(hq, generator=gen) * 2 if c["sinks"] else None
    pads = c["leftpad"] or [0] * batch
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=c["causal"], window_size=c["window"],
                  softcap=c["softcap"], sinks=sinks, num_splits=c["num_splits"], scale=c["scale"], return_lse=True,
                  cache_leftpad=torch.tensor(pads, dtype=torch.int32) if c["leftpad"] else None, backend="triton_fa2")
    dense_k, dense_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        if new:
            dense_k[b, n:n + new], dense_v[b, n:n + new] = k_new[b], v_new[b]
    page = c["page_size"]
    if page:
        per_seq = -(-capacity // page)
        k_cache, v_cache = (torch.cat([t, torch.full((batch, per_seq * page - capacity, *t.shape[2:]), float("nan"),
                                                      dtype=t.dtype)], 1) for t in (k_cache, v_cache))
        table = random_table(gen, batch, per_seq, batch * per_seq + 2)
        pages = [as_pages(t, table, page, batch * per_seq + 2) for t in (k_cache, v_cache)]
        out, lse = attnforge.attention_with_kvcache(q, *pages, k_new, v_new, block_table=table, **kwargs)
    else:
        out, lse = attnforge.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert attnforge.last_decision().forward.backend == "triton_fa2", c
    ends = [n + new for n in lengths]
    scale = c["scale"] if c["scale"] is not None else D ** -0.5
    check(out, lse, expected(q, dense_k, dense_v, pads, ends, _causal_mask(c["causal"], c["window"]), scale,
                             c["softcap"], sinks), max(ends))


def draw_varlen(seed: int) -> dict:
    rnd = random.Random(seed)
    heads_kv = rnd.choice((1, 2))
    lengths_q = [rnd.choice((0, 1, 3, 17, 70)) for _ in range(rnd.choice((1, 2, 3, 4)))]
    lengths_k = [n if rnd.random() < 0.4 else rnd.choice((0, 1, 5, 17, 90)) for n in lengths_q]
    return dict(heads_kv=heads_kv, heads_q=heads_kv * rnd.choice((1, 2, 3)), head_dim=rnd.choice((32, 64)),
                lengths_q=lengths_q, lengths_k=lengths_k, sliced=[rnd.random() < 0.3 for _ in range(3)],
                causal=rnd.random() < 0.5,
                window=(rnd.choice((-1, 0, 3, 20)), rnd.choice((-1, 0, 5))) if rnd.random() < 0.3 else (-1, -1),
                softcap=rnd.choice((0.0, 0.0, 5.0)), sinks=rnd.random() < 0.25, alibi=rnd.random() < 0.2,
                scale=rnd.choice((None, None, 0.3)), grad=rnd.random() < 0.6,
                backend=rnd.choice(("triton_fa2", "triton_fa2", "triton_rocm")))


def packed_tensor(rows: int, heads: int, dim: int, sliced: bool, gen) -> torch.Tensor:
    """A (rows, heads, dim) fp16 tensor: dense, or a strided slice of a larger one."""
    if sliced:
        return torch.randn(rows + 3, heads + 1, dim + 8, generator=gen).half()[2:2 + rows, :heads, 4:4 + dim]
    return torch.randn(rows, heads, dim, generator=gen).half()


@pytest.mark.parametrize("seed", range(64))  # (600 passed when this was written)
def test_a_random_varlen_call_matches_fp64_math(seed, poisoned_empty):
    """attention_varlen with a random draw of the same kind (test_varlen.py's per-sequence checks): sequence counts,
    zero-length and one-token sequences, Nq != Nk per sequence, strided inputs, both Triton backends, gradients."""
    from .test_varlen import bhsd, check_forward, sequences

    c = draw_varlen(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = c["heads_q"], c["heads_kv"], c["head_dim"]
    lengths_q, lengths_k = c["lengths_q"], c["lengths_k"]
    q, k, v = (packed_tensor(sum(n), h, d, sliced, gen).requires_grad_(c["grad"])
               for n, h, sliced in zip((lengths_q, lengths_k, lengths_k), (hq, hkv, hkv), c["sliced"]))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_(c["grad"]) if c["sinks"] else None
    slopes = torch.rand(len(lengths_q), hq, generator=gen) * 0.5 if c["alibi"] else None
    features = dict(softcap=c["softcap"], sinks=sinks, alibi_slopes=slopes)
    call = dict(causal=c["causal"], window_size=c["window"], scale=c["scale"], return_lse=True, **features)
    backend = c["backend"]
    if max(lengths_q) == 0 or max(lengths_k) == 0:  # an empty problem: the kernels refuse it, and say so
        with pytest.raises(BackendUnavailableError, match="empty problem"):
            attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), backend=backend, **call)
        backend = None  # automatic dispatch serves it (zeros, LSE -inf or the sink's)
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), backend=backend,
                                          **call)
    decision = attnforge.last_decision()
    assert backend is None or (decision.forward.backend == backend and decision.forward.variant.varlen), c
    mask = _causal_mask(c["causal"], c["window"])
    scale = c["scale"] if c["scale"] is not None else d ** -0.5
    ulps = 4 * math.sqrt(max(*lengths_k, d))
    check_forward(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(), cu_q, cu_k, mask, scale, ulps,
                  **features)
    if not c["grad"]:
        return
    dout = torch.randn(out.shape, generator=gen).half()
    grads = torch.autograd.grad(out, (q, k, v) if sinks is None else (q, k, v, sinks), dout)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        assert not g.isnan().any(), f"{name} {c}"
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:  # no queries: dK = dV = 0; no keys: dQ = 0
            assert all((g[span] == 0).all() for g, span in zip(grads[:3], (rows, keys, keys))), (b, c)
            continue
        one = dict(features, alibi_slopes=None if slopes is None else slopes[b:b + 1], dout=bhsd(dout[rows]))
        args = (bhsd(q[rows].detach()), bhsd(k[keys].detach()), bhsd(v[keys].detach()))
        _, _, ref_grads = oracle(*args, mask=mask, scale=scale, **one)
        _, peer_grads = peer_error(*args, mask=mask, scale=scale, **one)
        assert_grads_close([bhsd(grads[0][rows]), bhsd(grads[1][keys]), bhsd(grads[2][keys])], ref_grads[:3],
                           peer_grads[:3], *args, bhsd(dout[rows]), mask, scale,
                           8 * math.sqrt(max(rows.stop - rows.start, keys.stop - keys.start, d)))
    if sinks is not None:  # the dense call's formula on this call's own packed output and LSE, in fp64
        share = torch.exp(sinks.detach().double()[:, None] - lse.detach().double())  # (heads, total_q)
        want = -(share * (dout.double() * out.detach().double()).sum(-1).T).sum(1)
        assert_close(f"dsinks {c}", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * max(sum(lengths_q), 1)))

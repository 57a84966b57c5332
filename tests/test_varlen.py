"""attention_varlen: packed (total_tokens, heads, dim) batches delimited by int32 cu_seqlens, FlashAttention's
layout, against fp64 math on each sequence alone: odd and zero lengths, Nq != Nk per sequence, GQA, causal
(bottom-right per sequence), windows, the LSE (heads, total_q), gradients; bad offsets are named."""

import math

import pytest
import torch

import attnforge
from attnforge import InvalidInputError
from attnforge.api import _causal_mask
from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.dispatch import costs as cost_model
from attnforge.dispatch.select import clear_caches
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error

LENGTHS_Q = [17, 0, 1, 40, 113]
LENGTHS_K = [23, 5, 0, 40, 1]


def packed(gen, lengths_q, lengths_k, heads=4, heads_kv=2, dim=16, dtype=torch.float32):
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen, dtype=dtype).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), heads_kv, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def per_sequence(t, cu):
    bounds = cu.tolist()
    return [t[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)), (True, (5, -1))])
def test_matches_each_sequence_alone(backend, causal, window, gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                          scale=0.3, window_size=window, return_lse=True, backend=backend)
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = _causal_mask(causal, window)
    ulps = 4 * math.sqrt(113)
    for qs, ks, vs, os_, ls, ds, dqs, dks, dvs in zip(*(per_sequence(t, cu_q) for t in (q,)),
                                                        per_sequence(k, cu_k), per_sequence(v, cu_k),
                                                        per_sequence(out, cu_q), per_sequence(lse.T, cu_q),
                                                        per_sequence(dout, cu_q), per_sequence(grads[0], cu_q),
                                                        per_sequence(grads[1], cu_k), per_sequence(grads[2], cu_k)):
        if qs.shape[0] == 0:
            continue
        if ks.shape[0] == 0:  # no key: 0 and -inf, no gradient
            assert (os_ == 0).all() and (ls == float("-inf")).all() and (dqs == 0).all()
            continue
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs, ds)]
        ref, ref_lse, ref_grads = oracle(*bhsd[:3], mask=mask, scale=0.3, dout=bhsd[3])
        peer, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=0.3, dout=bhsd[3])
        assert_close("out", os_.transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close("lse", ls.T.unsqueeze(0), ref_lse, ref_lse.float(), ulps=ulps)
        assert_grads_close([g.transpose(0, 1).unsqueeze(0) for g in (dqs, dks, dvs)], ref_grads, peer_grads,
                           *bhsd, mask, 0.3, ulps)


def test_every_sequence_empty_of_queries(gen):
    q, k, v, cu_q, cu_k = packed(gen, [0, 0], [3, 4])
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 0, 4, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cu_q=a["cu_q"].long()), "cu_seqlens_q must be a 1-D int32 tensor"),
    (lambda a: a.update(cu_k=torch.tensor([0, 30, 20, 69, 69, 70], dtype=torch.int32)), "without decreasing"),
    (lambda a: a.update(cu_q=torch.tensor([0, 17, 18, 58, 171], dtype=torch.int32)), "cu_seqlens_q has 4 sequences"),
    (lambda a: a.update(cu_k=torch.tensor([1, 23, 28, 28, 68, 69], dtype=torch.int32)), "from 0 to the packed length"),
    (lambda a: a.update(max_q=112), "max_seqlen_q must be an int at least the longest sequence \\(113\\)"),
    (lambda a: a.update(q=a["q"][None]), "q must be a \\(total_tokens, heads, head_dim\\) tensor"),
])
def test_bad_inputs_are_named(change, match, gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=113, max_k=40)
    change(args)
    with pytest.raises(InvalidInputError, match=match):
        attnforge.attention_varlen(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"],
                                   args["max_k"])


def check_per_sequence(q, k, v, cu_q, cu_k, out, lse, grads, dout, mask, scale, **features):
    """out, the LSE and (dq, dk, dv[, dsinks]) against fp64 math on each sequence alone."""
    slopes, sinks = features.get("alibi_slopes"), features.get("sinks")
    ulps = 4 * math.sqrt(113)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float64)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        if rows.stop == rows.start:
            continue
        one = dict(features, alibi_slopes=None if slopes is None else slopes[b:b + 1])
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys], dout[rows])]
        if keys.stop == keys.start:  # no key: 0, and the LSE is -inf or the sink's
            assert (out[rows] == 0).all() and (grads[0][rows] == 0).all()
            want = (torch.full_like(lse[:, rows], float("-inf")) if sinks is None
                    else sinks[:, None].expand_as(lse[:, rows]))
            assert torch.equal(lse[:, rows], want.detach().to(lse.dtype))
            continue  # (its sink's gradient: share 1 times delta 0)
        ref, ref_lse, ref_grads = oracle(*bhsd[:3], mask=mask, scale=scale, dout=bhsd[3], **one)
        peer, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=scale, dout=bhsd[3], **one)
        assert_close("out", out[rows].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close("lse", lse[:, rows].unsqueeze(0), ref_lse, ref_lse.float(), ulps=ulps)
        assert_grads_close([grads[i][s].transpose(0, 1).unsqueeze(0) for i, s in ((0, rows), (1, keys), (2, keys))],
                           ref_grads[:3], peer_grads[:3], *bhsd, mask, scale, ulps)
        if sinks is not None:
            dsinks += ref_grads[3]
    if sinks is not None:
        assert_close("dsinks", grads[3], dsinks, dsinks.float(), ulps=ulps)


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("features", ["softcap", "sinks", "alibi", "softcap+sinks+alibi"])
def test_score_features_match_each_sequence_alone(backend, features, gen):
    """softcap, sinks (differentiable) and ALiBi (a row of slopes per sequence) on a packed batch, with causal and
    GQA; every backend that serves them is checked against fp64 math per sequence."""
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K, dtype=torch.float64)
    kw = {}
    if "softcap" in features:
        kw["softcap"] = 1.5
    if "sinks" in features:
        kw["sinks"] = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    if "alibi" in features:
        kw["alibi_slopes"] = torch.rand(len(LENGTHS_Q), 4, generator=gen, dtype=torch.float64)
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True, scale=0.3, return_lse=True,
                                          backend=backend, **kw)
    assert attnforge.last_decision().problem.varlen
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    wrt = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
    grads = torch.autograd.grad(out, wrt, dout)
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, grads, dout, _causal_mask(True), 0.3, **kw)


def test_per_head_alibi_slopes_are_every_sequence_s(gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    slopes = torch.rand(4, generator=gen)
    one = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, alibi_slopes=slopes)
    rows = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, alibi_slopes=slopes.expand(5, 4))
    assert torch.equal(one, rows)
    with pytest.raises(InvalidInputError, match=r"alibi_slopes must be a float tensor of shape \(heads_q,\) = \(4,\) "
                                                r"or \(batch, heads_q\) = \(5, 4\), got \(4, 4\)"):
        attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, alibi_slopes=slopes.expand(4, 4))


@pytest.mark.parametrize("device,forward", [("H100", "cute_sm90"), ("A100", "triton_fa2"), ("MI300X", "triton_rocm"),
                                            ("cpu", "sdpa")])
def test_a_packed_batch_is_one_decision(device, forward):
    """One Decision for the whole packed batch: the Triton backends' VARLEN kernels where they serve (one launch,
    forward and backward), on Hopper cute_sm90's packed forward and backward (triton_fa2's VARLEN backward where
    cute_sm90's is turned off, bwd_variants.PACKED, the Decision saying so; see the next test for the cost table),
    sdpa one sequence at a time on the CPU."""
    d = attnforge.explain(device=device, dtype="bf16", head_dim=128, seqlen_q=1000, batch=8, causal=True,
                          needs_grad=True, varlen=True)
    assert d.ok and d.problem.varlen and "varlen" in d.problem.describe()
    assert d.forward.backend == forward
    if forward.startswith("triton"):
        assert d.forward.variant.varlen and d.backward.variant.varlen and d.backward.backend == forward
        assert "+varlen" in d.forward.variant.describe() and d.forward.variant.tile.loads == "pointer"
    if device == "H100":
        assert d.forward.variant.varlen and "packed (varlen)" in d.forward.variant.describe()
        if bwd_variants.PACKED:
            assert d.backward.backend == "cute_sm90" and d.backward.variant.varlen
        else:
            assert d.backward.backend == "triton_fa2" and d.backward.variant.varlen
            assert d.backward.reasons_of("cute_sm90") == (bwd_variants.PACKED_REASON,)
    assert all(c.evidence in ("", "unmeasured") for c in d.forward.candidates)  # cost tables time no packed batch


@pytest.mark.cost_tables
def test_hopper_takes_the_packed_backward_where_the_table_measures_its_dense_twin(monkeypatch):
    """Once served (bwd_variants.PACKED), cute_sm90's packed backward follows its packed forward where the shipped
    sm90 table measures the pairing for the dense batch of the same sequence count and longest lengths (8 sequences
    of 8 heads near 4k), and where it measures nothing of that class (one head near 1k: the preference order); not
    where it measures the class without the pairing (the measured plans decide), nor with deterministic=True (which
    it does not serve: triton_fa2's VARLEN does)."""
    monkeypatch.setattr(bwd_variants, "PACKED", True)
    clear_caches()
    wide = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4000, batch=8, heads=8, kv_heads=2,
                             causal=True, needs_grad=True, varlen=True)
    assert wide.backward.backend == "cute_sm90" and wide.backward.variant.varlen
    assert "packed (varlen)" in wide.backward.variant.describe()
    narrow = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=1000, batch=8, causal=True,
                               needs_grad=True, varlen=True)
    assert narrow.backward.backend == "cute_sm90" and narrow.backward.variant.varlen
    table = type(cost_model.table("sm90"))
    real = table.estimate
    # a table that measures the class with cute_sm90's forward and triton_fa2's backward only (FALLBACK_PLAN; the
    # pair's own figure stands in for it)
    monkeypatch.setattr(table, "estimate", lambda self, plan, problem, mode: (
        None if plan == bwd_variants.PLAN else
        real(self, bwd_variants.PLAN if plan == bwd_variants.FALLBACK_PLAN else plan, problem, mode)))
    clear_caches()
    unpaired = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4000, batch=8, heads=8,
                                 kv_heads=2, causal=True, needs_grad=True, varlen=True)
    assert unpaired.backward.backend == "triton_fa2"
    assert unpaired.backward.reasons_of("cute_sm90") == (bwd_variants.NOT_AUTO_BECAUSE,)
    monkeypatch.setattr(table, "estimate", real)
    clear_caches()
    fixed = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4000, batch=8, heads=8, kv_heads=2,
                              causal=True, needs_grad=True, varlen=True, deterministic=True)
    assert fixed.backward.backend == "triton_fa2"
    assert fixed.backward.reasons_of("cute_sm90") == (
        "its deterministic backward takes no packed (varlen) batch (the default one does)",)


def test_a_forced_backend_that_cannot_serve_a_packed_batch_says_why():
    d = attnforge.explain(device="H100", dtype="fp8", head_dim=128, seqlen_q=1000, batch=8, varlen=True,
                          backend="cute_sm90")
    assert not d.ok and "takes no packed (varlen) batch" in str(d)
    q, k, v, cu_q, cu_k = packed(torch.Generator().manual_seed(0), LENGTHS_Q, LENGTHS_K)
    with pytest.raises(attnforge.BackendUnavailableError, match="cute_sm90"):
        attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, backend="cute_sm90")  # (and no GPU here)


def test_the_lse_is_differentiable(gen):
    """return_lse's (heads, total_q) LSE carries a gradient into q and k (a context-parallel merge needs it)."""
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K, dtype=torch.float64)
    _, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True, return_lse=True)
    seen = lse.isfinite()
    dq, dk = torch.autograd.grad(lse[seen].sum(), (q, k))
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    b = 3  # sequence 3: 40 queries, 40 keys
    rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
    qs, ks = (t[s].detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t, s in ((q, rows), (k, keys)))
    vs = v[keys].detach().transpose(0, 1).unsqueeze(0)
    from attnforge.backends.reference import math_attention

    _, ref_lse = math_attention(qs, ks, vs, causal=True)
    ref_dq, ref_dk = torch.autograd.grad(ref_lse.sum(), (qs, ks))
    assert torch.allclose(dq[rows], ref_dq[0].transpose(0, 1)) and torch.allclose(dk[keys], ref_dk[0].transpose(0, 1))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend,features", [(None, ""), ("reference", "softcap+sinks"), ("sdpa", ""),
                                              ("reference", "alibi")])
def test_compiles_fullgraph_and_matches_eager(backend, features, compiler, gen):
    """attention_varlen under torch.compile(fullgraph=True) is one custom op: its output, LSE and gradients (the
    sinks' too) equal the eager call's, which the tests above check against fp64, with the same Decision."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    kw = {}
    if "softcap" in features:
        kw["softcap"] = 1.5
    if "sinks" in features:
        kw["sinks"] = torch.randn(4, generator=gen).requires_grad_()
    if "alibi" in features:
        kw["alibi_slopes"] = torch.rand(len(LENGTHS_Q), 4, generator=gen)

    def step(q, k, v):
        return attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True, return_lse=backend != "sdpa",
                                          backend=backend, **kw)

    compiled = torch.compile(step, fullgraph=True, backend=compiler)(q, k, v)
    decision = attnforge.last_decision()
    eager = step(q, k, v)
    assert attnforge.last_decision() == decision and decision.problem.varlen
    if backend == "sdpa":
        compiled, eager = (compiled, None), (eager, None)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    seeds = [torch.randn(compiled[0].shape, generator=gen)]
    if compiled[1] is not None:
        torch.testing.assert_close(compiled[1], eager[1], atol=1e-6, rtol=1e-6)
        seeds.append(torch.randn(compiled[1].shape, generator=gen).masked_fill(eager[1].isinf(), 0.0))
    outputs = [t for t in compiled if t is not None]
    grads = torch.autograd.grad(outputs, leaves, seeds)
    eager_grads = torch.autograd.grad([t for t in eager if t is not None], leaves, seeds)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-6, rtol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_opcheck(gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    sinks = torch.randn(4, generator=gen)
    args = (q, k, v, cu_q, cu_k, 113, 40, True, -1, -1, 0.3, 0.0, sinks, None, True, True, False, "reference")
    torch.library.opcheck(torch.ops.attnforge.attention_varlen.default, args)
    out, lse = (t.detach() for t in torch.ops.attnforge.attention_varlen.default(*args))
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    bwd = (dout, q.detach(), k.detach(), v.detach(), cu_q, cu_k, 113, 40, out, lse, dlse, True, -1, -1, 0.3, 0.0,
           sinks, None, True, False, "reference")
    torch.library.opcheck(torch.ops.attnforge.attention_varlen_backward.default, bwd)


def test_offsets_are_checked_when_the_compiled_graph_runs(gen):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    step = torch.compile(lambda q, k, v, cu: attnforge.attention_varlen(q, k, v, cu, cu_k, 113, 40), fullgraph=True,
                         backend="aot_eager")
    bad = cu_q.clone()
    bad[2] = 30  # decreasing after 17, 30 > 17 + 0
    bad[3] = 20
    with pytest.raises(InvalidInputError, match="cu_seqlens_q must go from 0 to the packed length 171 without"):
        step(q, k, v, bad)


def test_double_backward_is_a_clear_error(gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    out = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True, backend="reference")
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(attnforge.BackendUnavailableError, match="second-order gradients"):
        torch.autograd.grad(dq.sum(), v)


def test_autocast_runs_the_autocast_dtype(gen):
    """Inside torch.autocast the packed call runs in the autocast dtype, as attention() and SDPA do."""
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True)
    assert out.dtype == torch.bfloat16 and attnforge.last_decision().problem.dtype == "bf16"
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads)


def test_offsets_are_read_once_per_tensor_and_again_after_a_change(gen):
    """The host copy of the offsets is kept per tensor (a model's layers share one, and only the first waits for the
    device); an in-place change through torch bumps the tensor's version, and the next call reads it again."""
    from attnforge import varlen

    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    first = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40)
    read = varlen._host_offsets(cu_q, cu_k)
    assert varlen._host_offsets(cu_q, cu_k) is read and read == (tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    # move a query row from sequence 3 to sequence 4 (its keys stay): a different batch, read again
    cu_q[4] -= 1
    again = varlen._host_offsets(cu_q, cu_k)
    assert again is not read and again[0] == tuple(cu_q.tolist())
    second = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 114, 40)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        one = attnforge.attention(q[rows][None], k[keys][None], v[keys][None], layout="bshd")[0]
        torch.testing.assert_close(second[rows], one)
    assert not torch.equal(first, second)
    copy = cu_q.clone()  # equal offsets in another tensor: read for that tensor
    assert varlen._host_offsets(copy, cu_k) == again and varlen._host_offsets(copy, cu_k) is not again


def test_inference_mode_offsets_are_read_on_every_call(gen):
    """Offsets made under torch.inference_mode() (a serving loop's) have no version counter: the packed call runs on
    them, and an in-place change to them is seen by the next call."""
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    with torch.inference_mode():
        cu_q, cu_k = cu_q.clone(), cu_k.clone()
        first = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 113, 40, causal=True)
        cu_q[4] -= 1  # a query row moves from sequence 3 to sequence 4
        second = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 114, 40, causal=True)
        bq, bk = cu_q.tolist(), cu_k.tolist()
        for b in range(len(LENGTHS_Q)):
            rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
            one = attnforge.attention(q[rows][None], k[keys][None], v[keys][None], layout="bshd", causal=True)[0]
            torch.testing.assert_close(second[rows], one)
    assert cu_q.is_inference() and not torch.equal(first, second)

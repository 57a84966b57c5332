"""On an H100/H200: cute_sm90's packed (VARLEN) forward through attention_varlen(backend="cute_sm90") against fp64
math per sequence, outputs NaN-filled before the call (poisoned_empty) so a row no CTA writes shows: mixed lengths
(0, 1, 17, 64, 113, 128, 1023, 4099) with Nq != Nk per sequence, so tiles end mid-warpgroup (register stores) and on
a warpgroup's edge (TMA stores), sequences with queries and no keys, GQA, causal, windows, softcap, sinks and ALiBi,
every tile family of the table (d=8 with its padded head dim); the backward from this forward's output and LSE on the
plain cases: cute_sm90's packed backward where its table serves the head dim, served here whatever
bwd_variants.PACKED, SPLIT_HEAD_DIM_FEATURES_SERVED (the head-dim-256 kernel's packed form) and UNMASKED_ONLY_SERVED
(d=128's 80-row tile without a mask or window) say
(sequences with keys and no queries included: their dK and dV are zeros it must write; sequences starting at rows
that are not a multiple of four: the LSE's padded rows), triton_fa2's VARLEN one at the others; and cute_sm90's
packed backward with sliding windows."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.dispatch.select import clear_caches
from attnforge.testing import assert_close, assert_grads_close, needs_gpu, oracle, peer_error

pytestmark = [pytest.mark.gpu, needs_gpu((9, 0), "sm90")]


@pytest.fixture(autouse=True)
def packed_backward_served(monkeypatch):
    """cute_sm90's packed backward served (bwd_variants.PACKED, and at head dim 256 SPLIT_HEAD_DIM_FEATURES_SERVED),
    these tests being what its serving waits for."""
    monkeypatch.setattr(bwd_variants, "PACKED", True)
    monkeypatch.setattr(bwd_variants, "SPLIT_HEAD_DIM_FEATURES_SERVED", True)
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", True)  # (d=128's 80-row tile without a mask or window)
    clear_caches()
    yield
    clear_caches()  # (the flags are restored after this: no Decision made with them outlives the test)

LENGTHS_Q = [17, 0, 1, 1023, 113, 4099, 128, 64]
LENGTHS_K = [17, 9, 0, 1023, 4099, 113, 128, 200]
# (heads_q, heads_kv, causal, window, softcap, sinks, alibi)
CASES = [(8, 2, True, (-1, -1), 0.0, False, False), (4, 4, False, (-1, -1), 0.0, False, False),
         (8, 1, True, (255, -1), 30.0, True, False), (4, 2, False, (17, 100), 0.0, False, True)]
# a head dim of each tile family: 192x128 with 3 warpgroups (8: padded to 16, and 64), 128x176 (96), the persistent
# 128x128 (128, run one CTA per tile here), 128x112 (192), 128x64 (256)
HEAD_DIMS = [(torch.bfloat16, d) for d in (8, 64, 96, 128, 192, 256)] + [(torch.float16, 128)]


def packed(gen, heads, heads_kv, d, dtype):
    q = torch.randn(sum(LENGTHS_Q), heads, d, generator=gen).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(sum(LENGTHS_K), heads_kv, d, generator=gen).to("cuda", dtype).requires_grad_()
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (LENGTHS_Q, LENGTHS_K))
    return q, k, v, cu_q, cu_k


def _packed_backward_backend(head_dim: int, masked: bool) -> str:
    """cute_sm90 where its table serves a packed backward at ``head_dim`` (the padded kernels included, where
    bwd_variants.PADDED_SERVED), else triton_fa2."""
    tile, _ = bwd_variants.pick(head_dim, masked=masked)
    tile = tile and bwd_variants.staging_for(tile, False, True, False, False)  # (a packed batch's dQ staging)
    served = tile is not None and not bwd_variants.feature_reasons(tile, False, True, False, False)
    return "cute_sm90" if served else "triton_fa2"


@pytest.mark.parametrize("dtype, head_dim", HEAD_DIMS, ids=[f"{'bf16' if t == torch.bfloat16 else 'fp16'}_d{d}"
                                                             for t, d in HEAD_DIMS])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_forward_matches_fp64_per_sequence(case, dtype, head_dim, gen, poisoned_empty):
    hq, hkv, causal, window, cap, with_sinks, with_alibi = case
    q, k, v, cu_q, cu_k = packed(gen, hq, hkv, head_dim, dtype)
    sinks = (torch.randn(hq, generator=gen) * 2).cuda() if with_sinks else None
    slopes = (torch.rand(len(LENGTHS_Q), hq, generator=gen) * 0.1).cuda() if with_alibi else None
    grad = not (with_sinks or with_alibi or cap)  # (the backward of the feature cases is triton_fa2's own business)
    with torch.set_grad_enabled(grad):
        out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                              window_size=window, softcap=cap, sinks=sinks, alibi_slopes=slopes,
                                              return_lse=True, backend="cute_sm90")
    decision = attnforge.last_decision()
    assert decision.forward.backend == "cute_sm90" and decision.forward.variant.varlen
    if grad:
        assert decision.backward.variant.varlen
        masked = causal or window != (-1, -1)
        assert decision.backward.backend == _packed_backward_backend(head_dim, masked), decision
    dout = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout) if grad else None
    for name, t in (("out", out), ("lse", lse), *(zip(("dq", "dk", "dv"), grads) if grad else ())):
        assert not t.isnan().any(), f"{name}: NaN (an unwritten row, or a wrong one)"
    mask = _causal_mask(causal, window)
    scale = head_dim ** -0.5
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # queries and no key: 0 out, LSE -inf (with sinks: the sink)
            assert (out[rows] == 0).all()
            expected = (sinks[:, None] if with_sinks else torch.full((hq, 1), -math.inf, device="cuda"))
            torch.testing.assert_close(lse[:, rows], expected.expand(hq, rows.stop - rows.start), rtol=1e-6, atol=1e-6)
            continue
        bhsd = [t.detach().transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys], dout[rows])]
        alibi = slopes[b:b + 1] if with_alibi else None
        ref, ref_lse, ref_grads = oracle(*bhsd[:3], mask=mask, scale=scale, softcap=cap, sinks=sinks,
                                         alibi_slopes=alibi, dout=bhsd[3] if grad else None)
        peer, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=scale, softcap=cap, sinks=sinks, alibi_slopes=alibi,
                                      dout=bhsd[3] if grad else None)
        # (floored at 128 keys: the kernel's exp2, log2 and tanh are MUFU approximations whose error does not shrink
        # with a short sequence; 128 is below the dense feature tests' shortest bound)
        ulps = 4 * math.sqrt(max(rows.stop - rows.start, keys.stop - keys.start, head_dim, 128))
        assert_close(f"out[{b}]", out[rows].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[:, rows].unsqueeze(0), ref_lse, ref_lse.float(), ulps=ulps)
        if grad:
            mine = [g.transpose(0, 1).unsqueeze(0) for g in (grads[0][rows], grads[1][keys], grads[2][keys])]
            assert_grads_close(mine, ref_grads[:3], peer_grads[:3], *bhsd, mask, scale, 2 * ulps)


# (heads_q, heads_kv, causal, window): a window on the left with causal, on both sides without
WINDOW_CASES = [(8, 2, True, (255, -1)), (4, 4, False, (17, 100)), (4, 1, False, (300, 0))]


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 128),
                                              (torch.bfloat16, 256)],
                         ids=("bf16_d64", "bf16_d128", "fp16_d128", "bf16_d256"))
@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
@pytest.mark.parametrize("split_loops", (False, True), ids=("table", "split_loops"))
def test_packed_backward_with_a_window_matches_fp64_per_sequence(case, split_loops, dtype, head_dim, gen,
                                                                  poisoned_empty, twin_table):
    """With the table's tiles, and their split_loops twins (three loops per query head: the masked blocks before the
    window's near edge, the unmasked ones, the masked ones past its far edge or a sequence's end)."""
    hq, hkv, causal, window = case
    if split_loops:
        twin_table(split_loops=True)
    q, k, v, cu_q, cu_k = packed(gen, hq, hkv, head_dim, dtype)
    out = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                     window_size=window, backend="cute_sm90")
    decision = attnforge.last_decision()
    assert decision.backward.backend == "cute_sm90" and decision.backward.variant.varlen
    assert decision.backward.variant.window and decision.backward.variant.tile.split_loops == split_loops
    dout = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, t in zip(("dq", "dk", "dv"), grads):
        assert not t.isnan().any(), f"{name}: NaN (an unwritten row, or a wrong one)"
    mask, scale = _causal_mask(causal, window), head_dim ** -0.5
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:  # no queries: dK = dV = 0; no keys: dQ = 0
            for g, span in ((grads[0], rows), (grads[1], keys), (grads[2], keys)):
                assert (g[span] == 0).all()
            continue
        bhsd = [t.detach().transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys], dout[rows])]
        _, _, ref_grads = oracle(*bhsd[:3], mask=mask, scale=scale, dout=bhsd[3])
        _, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=scale, dout=bhsd[3])
        ulps = 8 * math.sqrt(max(rows.stop - rows.start, keys.stop - keys.start, head_dim, 128))
        mine = [g.transpose(0, 1).unsqueeze(0) for g in (grads[0][rows], grads[1][keys], grads[2][keys])]
        assert_grads_close(mine, ref_grads[:3], peer_grads[:3], *bhsd, mask, scale, ulps)


@pytest.mark.cost_tables
def test_automatic_dispatch_takes_the_packed_forward_and_backward(gen):
    """A packed batch whose dense twin (sequence count, longest lengths) the shipped table measures takes cute_sm90's
    packed backward; deterministic=True takes triton_fa2's VARLEN one, with the reason."""
    q, k, v, cu_q, cu_k = packed(gen, 8, 2, 128, torch.bfloat16)
    attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=True)
    d = attnforge.last_decision()
    assert d.forward.backend == "cute_sm90" and d.forward.variant.varlen
    assert d.backward.backend == "cute_sm90" and d.backward.variant.varlen
    attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=True, deterministic=True)
    d = attnforge.last_decision()
    assert d.backward.backend == "triton_fa2" and d.backward.variant.varlen
    assert "takes no packed (varlen) batch" in " ".join(d.backward.reasons_of("cute_sm90"))

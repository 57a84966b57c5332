"""On an H100/H200: cute_sm90's WINDOW, SOFTCAP, SINKS and ALIBI forward kernels through attention(backend="cute_sm90") against
fp64 math, outputs poisoned (NaN) before the call so an element no CTA writes shows: windows on one and both sides,
with and without causal, Nq != Nk both ways (rows that see no key: 0 out, LSE -inf, or with sinks LSE = the sink),
GQA, odd lengths; the softcap alone and with a window; sinks alone and with both; ALiBi (per head and per batch and
head) alone and with all three; automatic dispatch's training (this forward and cute_sm90's backward, from this
forward's LSE) on one case per feature; the backward forced, with windows, softcap and ALiBi at d=64, 128 and 256, and
at d=80 and 192 (the 128 and 256 kernels with zero-filled columns); the head-dim-256 kernel's feature forms are served
here whatever bwd_variants.SPLIT_HEAD_DIM_FEATURES_SERVED says, these tests being what its serving waits for, and so
is d=128's 80-row tile for calls without a mask or window (UNMASKED_ONLY_SERVED); the same feature backwards at d=64,
128 and 80 with the flat_dq tiles as they are (FLAT_DQ_FEATURES_SERVED set for the test), which that flag waits for."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.dispatch.select import clear_caches
from attnforge.dispatch.problem import SMALL_SOFTCAP
from attnforge.testing import assert_close, assert_grads_close, needs_gpu, oracle, peer_error, sees

pytestmark = [pytest.mark.gpu, needs_gpu((9, 0), "sm90")]


@pytest.fixture(autouse=True)
def unmasked_only_served(monkeypatch):
    """The table's tiles for calls without a mask or window (d=128's 80-row one) served
    (bwd_variants.UNMASKED_ONLY_SERVED), these tests being part of what their serving waits for."""
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", True)
    clear_caches()
    yield
    clear_caches()  # (the flag is restored after this: no Decision made with it outlives the test)


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, causal, window, softcap, sinks[, alibi slopes' shape: "h" or "bh"])
CASES = [
    (2, 4, 2, 1023, 1023, True, (255, -1), 0.0, False),    # Mistral's: causal + a left window, edges inside blocks
    (1, 4, 4, 113, 1023, False, (17, 17), 0.0, False),     # two-sided, Nq < Nk (bottom-right): most key blocks skipped
    (1, 4, 1, 1023, 113, True, (37, -1), 0.0, False),      # Nq > Nk: the first rows see no key
    (1, 2, 2, 777, 4099, False, (-1, 300), 0.0, False),    # right bound only
    (1, 2, 2, 4099, 4099, True, (4096, -1), 0.0, False),   # a window wider than most rows' history
    (2, 4, 2, 1023, 1023, True, (-1, -1), 30.0, False),    # Gemma 2's softcap, causal
    (1, 4, 4, 300, 700, False, (-1, -1), 5.0, False),      # a tight cap (scores often saturate), Nq != Nk
    (2, 4, 2, 1023, 1023, True, (127, -1), 50.0, False),   # both
    (2, 8, 2, 1023, 1023, True, (-1, -1), 0.0, True),      # gpt-oss's sinks
    (1, 4, 1, 1023, 113, True, (-1, -1), 0.0, True),       # sinks where the first rows see no key: LSE = the sink
    (2, 4, 2, 1023, 1023, True, (127, -1), 30.0, True),    # all three
    (2, 4, 2, 113, 1023, False, (-1, -1), 0.0, False, "bh"),  # ALiBi, slopes per (batch, head), Nq < Nk
    (2, 4, 2, 1023, 1023, True, (-1, -1), 0.0, False, "h"),   # ALiBi per head, causal
    (2, 4, 2, 1023, 1023, True, (255, -1), 30.0, True, "bh"),  # all four
    (2, 4, 2, 1023, 1023, True, (-1, -1), 64.0, False),    # a cap above SMALL_SOFTCAP: bf16 keeps the running max
]


def slopes_for(case, gen):
    """The case's ALiBi slopes (FlashAttention's shapes: (heads_q,) or (batch, heads_q)), or None."""
    shape = case[9] if len(case) > 9 else None
    if shape is None:
        return None
    b, hq = case[0], case[1]
    return (torch.rand(*((b, hq) if shape == "bh" else (hq,)), generator=gen) * 0.1).cuda()
# every kernel family of the table: d=64 (3 consumer warpgroups), 128 (persistent tile, run one CTA per tile here),
# 256 (64-key blocks), 96 (a head dim between)
HEAD_DIMS = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.bfloat16, 96), (torch.float16, 128)]


@pytest.mark.parametrize("dtype, head_dim", HEAD_DIMS, ids=[f"{'bf16' if t == torch.bfloat16 else 'fp16'}_d{d}"
                                                             for t, d in HEAD_DIMS])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_window_and_softcap_forward_match_fp64(case, dtype, head_dim, gen, poisoned_empty):
    b, hq, hkv, nq, nk, causal, window, cap, with_sinks = case[:9]
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to("cuda", dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    sinks = (torch.randn(hq, generator=gen) * 2).cuda() if with_sinks else None
    slopes = slopes_for(case, gen)
    out, lse = attnforge.attention(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=sinks,
                                   alibi_slopes=slopes, return_lse=True, backend="cute_sm90")
    variant = attnforge.last_decision().forward.variant
    assert variant.features == tuple(f for f, on in (("window", window != (-1, -1)), ("softcap", cap > 0),
                                                      ("sinks", with_sinks), ("alibi", slopes is not None)) if on)
    # bf16 caps up to SMALL_SOFTCAP without ALiBi run the FIXED_MAX softmax (no running max); the others the running one
    assert variant.fixed_max == (dtype == torch.bfloat16 and 0 < cap <= SMALL_SOFTCAP and slopes is None)
    assert not out.isnan().any() and not lse.isnan().any(), "an unwritten element (or a wrong one)"
    mask = _causal_mask(causal, window)
    features = dict(mask=mask, softcap=cap, sinks=sinks, alibi_slopes=slopes)
    ref, ref_lse, _ = oracle(q, k, v, **features)
    peer, _ = peer_error(q, k, v, **features)
    ulps = 4 * math.sqrt(max(nq, nk, head_dim))
    assert_close("out", out, ref, peer, ulps=ulps)
    blind = (~sees(mask, nq, nk).any(-1)).cuda()  # rows the rule hides every key from
    assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind])), "rows that see no key: output 0"
    if with_sinks:  # every LSE is finite, a blind row's is its sink
        # (to fp32 rounding: the kernel forms it as (sink * log2(e) + log2(1)) * ln(2))
        torch.testing.assert_close(lse[:, :, blind], sinks[None, :, None].expand(b, hq, nq)[:, :, blind].float(),
                                   rtol=1e-6, atol=1e-6)
        assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    else:
        finite = ref_lse.isfinite()
        assert torch.equal(lse[~finite], ref_lse[~finite].float()), "rows that see no key: LSE -inf"
        assert_close("lse", lse[finite], ref_lse[finite], ref_lse[finite].float(), ulps=ulps)


@pytest.mark.parametrize("head_dim", [128, 64])  # (64: FIXED_MAX with part of its exp2s on the FMA pipe)
@pytest.mark.parametrize("cap", [5.0, SMALL_SOFTCAP, 64.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softcap_rows_whose_every_score_sits_at_minus_the_cap(cap, dtype, head_dim, gen, poisoned_empty):
    """Every other query row scores far below -cap against every key (tanh saturates at -1), so its probabilities
    are all near the smallest the cap allows: with FIXED_MAX (bf16, cap <= SMALL_SOFTCAP) each is about
    2^(32 - 2 cap log2(e)), 2^-123.8 at SMALL_SOFTCAP, which must stay a normal fp32; the running max elsewhere."""
    b, h, n, d = 1, 4, 1023, head_dim
    k = (torch.rand(b, h, n, d, generator=gen) + 0.5).to("cuda", dtype)  # positive entries
    q = torch.randn(b, h, n, d, generator=gen)
    # scores about -226 at d=128 (-160 at d=64): tanh -> -1
    q[:, :, ::2] = -20 * (torch.rand(b, h, (n + 1) // 2, d, generator=gen) + 0.5)
    q = q.to("cuda", dtype)
    v = torch.randn(b, h, n, d, generator=gen).to("cuda", dtype)
    out, lse = attnforge.attention(q, k, v, causal=True, softcap=cap, return_lse=True, backend="cute_sm90")
    assert attnforge.last_decision().forward.variant.fixed_max == (dtype == torch.bfloat16 and cap <= SMALL_SOFTCAP)
    assert not out.isnan().any() and not lse.isnan().any()
    mask = _causal_mask(True, (-1, -1))
    ref, ref_lse, _ = oracle(q, k, v, mask=mask, softcap=cap)
    peer, _ = peer_error(q, k, v, mask=mask, softcap=cap)
    ulps = 4 * math.sqrt(n)
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[7], CASES[10], CASES[13]], ids=str)
def test_automatic_training_runs_cute_sm90s_forward_and_backward(case, gen, poisoned_empty):
    b, hq, hkv, nq, nk, causal, window, cap, with_sinks = case[:9]
    slopes = slopes_for(case, gen)
    q, k, v = (torch.randn(b, h, n, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    sinks = (torch.randn(hq, generator=gen) * 2).cuda().requires_grad_() if with_sinks else None
    out, lse = attnforge.attention(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=sinks,
                                   alibi_slopes=slopes, return_lse=True)
    decision = attnforge.last_decision()
    assert (decision.forward.backend, decision.backward.backend) == ("cute_sm90", "cute_sm90"), decision
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v) if sinks is None else (q, k, v, sinks), dout)
    assert not any(g.isnan().any() for g in grads)
    mask = _causal_mask(causal, window)
    features = dict(mask=mask, softcap=cap, sinks=sinks, alibi_slopes=slopes, dout=dout)
    ref, _, ref_grads = oracle(q, k, v, **features)
    peer, peer_grads = peer_error(q, k, v, **features)
    ulps = 4 * math.sqrt(max(nq, nk, 128))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads[:3], ref_grads[:3], peer_grads[:3], q, k, v, dout, mask, 128 ** -0.5, 2 * ulps)
    if sinks is not None:  # dsinks from this call's own O and LSE, as tests/backends/triton_fa2 check it
        share = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())
        want = -(share * (dout.double() * out.detach().double()).sum(-1)).sum((0, 2))
        assert_close("dsinks", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * nq))


# the backward kernels' own head dims (bwd_variants.KERNEL_HEAD_DIMS), and 80 and 192 on the 128 and 256 kernels with
# zero-filled columns (bwd_variants.kernel_head_dim)
FEATURE_BACKWARD_HEAD_DIMS = [64, 128, 80, 256, 192]


@pytest.fixture
def split_features_served(monkeypatch):
    """The head-dim-256 kernel's feature forms served (bwd_variants.SPLIT_HEAD_DIM_FEATURES_SERVED)."""
    monkeypatch.setattr(bwd_variants, "SPLIT_HEAD_DIM_FEATURES_SERVED", True)
    clear_caches()
    yield
    clear_caches()  # (the flag is restored after this: no Decision made with it outlives the test)


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, causal, window, with sinks): cute_sm90's WINDOW backward
WINDOW_BACKWARD = [
    (2, 4, 2, 1023, 1023, True, (255, -1), False),   # Mistral's
    (1, 4, 4, 113, 1023, False, (17, 17), False),    # two-sided, Nq < Nk: most key blocks see no query block
    (1, 4, 1, 1023, 113, True, (37, -1), False),     # Nq > Nk: the first rows see no key
    (2, 8, 2, 1023, 1023, True, (127, -1), True),    # gpt-oss's: window and sinks
]


@pytest.mark.parametrize("head_dim", FEATURE_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("case", WINDOW_BACKWARD, ids=str)
def test_forced_window_backward_matches_fp64(case, head_dim, gen, poisoned_empty, split_features_served):
    b, hq, hkv, nq, nk, causal, window, with_sinks = case
    check_forced_backward((b, hq, hkv, nq, nk, causal, window, 0.0, with_sinks), head_dim, gen)


# CASES' layout: cute_sm90's SOFTCAP and ALIBI backward, alone and with the others
FEATURE_BACKWARD = [
    (2, 4, 2, 1023, 1023, True, (-1, -1), 30.0, False),        # Gemma 2's softcap, causal
    (1, 4, 4, 300, 700, False, (-1, -1), 5.0, False),          # a tight cap (scores often saturate), Nq != Nk
    (1, 4, 1, 1023, 113, True, (-1, -1), 30.0, False),         # Nq > Nk: rows that see no key (LSE -inf)
    (2, 4, 2, 113, 1023, False, (-1, -1), 0.0, False, "bh"),   # ALiBi per (batch, head), Nq < Nk
    (2, 4, 2, 1023, 1023, True, (-1, -1), 0.0, False, "h"),    # ALiBi per head, causal
    (2, 4, 2, 1023, 1023, True, (255, -1), 30.0, True, "bh"),  # all four
    (2, 4, 2, 1023, 1023, True, (-1, -1), 64.0, False),    # a cap above SMALL_SOFTCAP: bf16 keeps the running max
]


@pytest.mark.parametrize("head_dim", FEATURE_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("case", FEATURE_BACKWARD, ids=str)
def test_forced_softcap_and_alibi_backward_matches_fp64(case, head_dim, gen, poisoned_empty, split_features_served):
    check_forced_backward(case, head_dim, gen)


@pytest.fixture
def flat_features_served(monkeypatch):
    """The flat_dq tiles serve calls with a window, softcap or ALiBi as they are (bwd_variants.FLAT_DQ_FEATURES_SERVED),
    these tests being what that waits for."""
    monkeypatch.setattr(bwd_variants, "FLAT_DQ_FEATURES_SERVED", True)
    clear_caches()
    yield
    clear_caches()  # (the flag is restored after this: no Decision made with it outlives the test)


# the head dims whose table tiles stage dQ flat: the 64 and 128 kernels, and 80 on the 128 one (zero-filled columns)
FLAT_FEATURE_HEAD_DIMS = [64, 128, 80]
FLAT_FEATURE_BACKWARD = [(*case[:7], 0.0, case[7]) for case in WINDOW_BACKWARD] + FEATURE_BACKWARD


@pytest.mark.parametrize("head_dim", FLAT_FEATURE_HEAD_DIMS)
@pytest.mark.parametrize("case", FLAT_FEATURE_BACKWARD, ids=str)
def test_forced_feature_backward_with_flat_dq_matches_fp64(case, head_dim, gen, poisoned_empty, flat_features_served):
    check_forced_backward(case, head_dim, gen, flat_dq=True)


# split_loops (each query head's masked and unmasked query blocks in loops of their own), a template option
# benchmarks/sweep_bwd_sm90.py --twin split_loops times: the table's tiles with it, in every feature form
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", FLAT_FEATURE_BACKWARD, ids=str)
def test_forced_feature_backward_with_split_loops_matches_fp64(case, head_dim, gen, poisoned_empty, flat_features_served,
                                                               split_features_served, twin_table):
    twin_table(split_loops=True)
    check_forced_backward(case, head_dim, gen, split_loops=True)


# persistent (bwd_variants.Sm90BwdTile.persistent), a template option benchmarks/sweep_bwd_sm90.py --twin persistent
# times: the tiles that take it (d=64, with its split_loops, d=128's masked-call tile, which the unmasked calls then
# take too, and 80 on it) in every feature form; the two-sided window with Nq < Nk leaves most key blocks no query block
# (tiles that only store zeros)
@pytest.mark.parametrize("head_dim", FLAT_FEATURE_HEAD_DIMS)
@pytest.mark.parametrize("case", FLAT_FEATURE_BACKWARD, ids=str)
def test_forced_feature_backward_persistent_matches_fp64(case, head_dim, gen, poisoned_empty, flat_features_served,
                                                         twin_table):
    twin_table(persistent=True)
    check_forced_backward(case, head_dim, gen, split_loops=None, persistent=True)


def check_forced_backward(case, head_dim, gen, flat_dq=None, split_loops=False, persistent=False):
    """cute_sm90's forward and backward forced on a CASES-style case (bf16): gradients against fp64 math (dsinks from
    the call's own output and LSE), gradients NaN-poisoned where the host allocates them (poisoned_empty); ``flat_dq``
    (not None): whether the backward's tile must stage dQ flat; ``split_loops`` (not None), ``persistent``: whether it
    must run that option."""
    b, hq, hkv, nq, nk, causal, window, cap, with_sinks = case[:9]
    slopes = slopes_for(case, gen)
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    sinks = (torch.randn(hq, generator=gen) * 2).cuda().requires_grad_() if with_sinks else None
    out, lse = attnforge.attention(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=sinks,
                                   alibi_slopes=slopes, return_lse=True, backend="cute_sm90")
    decision = attnforge.last_decision()
    variant = decision.backward.variant
    assert decision.backward.backend == "cute_sm90", decision
    assert (variant.window, variant.softcap, variant.alibi) == (window != (-1, -1), bool(cap), slopes is not None)
    assert flat_dq is None or variant.tile.flat_dq == flat_dq, variant
    assert split_loops is None or variant.tile.split_loops == split_loops, variant
    assert variant.tile.persistent == persistent, variant
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v) if sinks is None else (q, k, v, sinks), dout)
    assert not any(g.isnan().any() for g in grads), "an unwritten gradient element (or a wrong one)"
    mask = _causal_mask(causal, window)
    features = dict(mask=mask, softcap=cap, sinks=sinks, alibi_slopes=slopes, dout=dout)
    ref, _, ref_grads = oracle(q, k, v, **features)
    peer, peer_grads = peer_error(q, k, v, **features)
    ulps = 4 * math.sqrt(max(nq, nk, head_dim))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads[:3], ref_grads[:3], peer_grads[:3], q, k, v, dout, mask, head_dim ** -0.5, 2 * ulps)
    if sinks is not None:
        share = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())
        want = -(share * (dout.double() * out.detach().double()).sum(-1)).sum((0, 2))
        assert_close("dsinks", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * nq))

"""ALiBi in the Triton kernels (ALIBI: -slope * |i + Nk - Nq - j| on the scores), in Triton's interpreter on CPU
tensors, against fp64 math on every tile either Triton backend can pick, forward and backward, per-head and
per-(batch, head) slopes, alone and with causal masks, windows, softcap and sinks; and the public call in fp16.
Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention, explain  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error  # noqa: E402

from .test_interpreter import (BWD_TILES, FWD_TILES, feature_case_id, inputs, launch_window, module,  # noqa: E402
                               tile_id)

# (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap, per-batch slopes, sinks)
CASES = [(4, 2, 113, 67, 32, True, (-1, -1), 0.0, False, False), (2, 2, 130, 130, 64, False, (-1, -1), 0.0, True, False),
         (2, 1, 67, 190, 32, False, (20, 5), 2.0, False, True)]


def case_id(c):
    return f"{feature_case_id(c)}{'-per_batch' if c[8] else ''}{'-sinks' if c[9] else ''}"


def slopes_for(gen, batch, heads, per_batch):
    """ALiBi's geometric slopes 2^(-8 i / heads), permuted per batch where asked (so a wrong batch stride shows)."""
    base = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    if not per_batch:
        return base
    return torch.stack([base[torch.randperm(heads, generator=gen)] * (1 + b) for b in range(batch)])


@pytest.mark.parametrize("tile", FWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap, per_batch, with_sinks = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 2, hq, hkv, nq, nk, d, torch.float32)
    slopes = slopes_for(gen, 2, hq, per_batch)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    module(tile).launch(q, k, v, out, lse, causal=causal, scale=0.3, window=launch_window(mask), softcap=cap,
                        sinks=sinks, alibi_slopes=slopes.expand(2, hq).contiguous() if not per_batch else slopes)
    ref, ref_lse, _ = oracle(q, k, v, mask=mask, scale=0.3, softcap=cap, sinks=sinks, alibi_slopes=slopes)
    peer, _ = peer_error(q, k, v, mask=mask, scale=0.3, softcap=cap, sinks=sinks, alibi_slopes=slopes)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("tile", BWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap, per_batch, with_sinks = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 2, hq, hkv, nq, nk, d, torch.float32)
    slopes = slopes_for(gen, 2, hq, per_batch)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    dout = torch.randn(q.shape, generator=gen)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.3, dout=dout, softcap=cap, sinks=sinks,
                                     alibi_slopes=slopes)
    _, peer_grads = peer_error(q, k, v, mask=mask, scale=0.3, dout=dout, softcap=cap, sinks=sinks, alibi_slopes=slopes)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    module(tile).launch(q, k, v, ref.float(), ref_lse.float(), dout, *grads, causal=causal, scale=0.3,
                        window=launch_window(mask), softcap=cap,
                        alibi_slopes=slopes.expand(2, hq).contiguous() if not per_batch else slopes)
    ulps = 4 * math.sqrt(max(nq, nk, d)) + ref_lse[torch.isfinite(ref_lse)].abs().max().item()
    assert_grads_close(grads, ref_grads[:3], peer_grads[:3], q, k, v, dout, mask, 0.3, ulps)


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_fp16_forward_and_backward(backend, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap, per_batch, with_sinks = case
    mask = _causal_mask(causal, window)
    q, k, v = (t.requires_grad_() for t in inputs(gen, 2, hq, hkv, nq, nk, d, torch.float16))
    slopes = slopes_for(gen, 2, hq, per_batch)
    decision = explain(q, k, v, causal=causal, window_size=window, softcap=cap, alibi=True, needs_grad=True,
                       backend=backend)
    assert (decision.forward.backend, decision.backward.backend) == (backend, backend)
    assert decision.forward.variant.alibi and "alibi" in decision.problem.describe()
    out = attention(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes, backend=backend)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _, ref_grads = oracle(q, k, v, mask=mask, dout=dout, softcap=cap, alibi_slopes=slopes)
    peer, peer_grads = peer_error(q, k, v, mask=mask, dout=dout, softcap=cap, alibi_slopes=slopes)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, d ** -0.5, ulps)
    plain = oracle(q, k, v, mask=mask, softcap=cap)[0]
    assert (plain - ref).abs().max() > 10 * (out.double() - ref).abs().max()  # the bias changed the answer

"""The softcap in the Triton kernels (SOFTCAP), in Triton's interpreter on CPU tensors, against fp64 math on
every tile either Triton backend can pick, forward and backward, alone and with causal masks and windows; and
the public call in fp16. Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

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

# (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap). Scores are q.k * 0.3 with unit
# inputs (|s| up to ~5 at d=64), so a cap of 2 bends most of them and 0.5 flattens them; 30 barely touches them.
CASES = [(2, 1, 113, 67, 64, True, (-1, -1), 2.0), (2, 2, 130, 130, 32, False, (-1, -1), 0.5),
         (4, 2, 67, 190, 32, False, (20, 5), 2.0), (1, 1, 17, 17, 16, True, (-1, -1), 30.0)]


@pytest.mark.parametrize("tile", FWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=feature_case_id)
def test_forward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    module(tile).launch(q, k, v, out, lse, causal=causal, scale=0.3, window=launch_window(mask), softcap=cap)
    ref, ref_lse, _ = oracle(q, k, v, mask=mask, scale=0.3, softcap=cap)
    peer, _ = peer_error(q, k, v, mask=mask, scale=0.3, softcap=cap)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    plain, _, _ = oracle(q, k, v, mask=mask, scale=0.3)
    if cap < 10:  # the cap changed the answer (a kernel that ignored it would fail above)
        assert (plain - ref).abs().max() > 100 * (out - ref).abs().max()


@pytest.mark.parametrize("tile", BWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=feature_case_id)
def test_backward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    dout = torch.randn(q.shape, generator=gen)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.3, dout=dout, softcap=cap)
    _, peer_grads = peer_error(q, k, v, mask=mask, scale=0.3, dout=dout, softcap=cap)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    module(tile).launch(q, k, v, ref.float(), ref_lse.float(), dout, *grads, causal=causal, scale=0.3,
                        window=launch_window(mask), softcap=cap)
    ulps = 4 * math.sqrt(max(nq, nk, d)) + ref_lse[torch.isfinite(ref_lse)].abs().max().item()
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, 0.3, ulps)


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES[:3], ids=feature_case_id)
def test_attention_fp16_forward_and_backward(backend, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap = case
    mask = _causal_mask(causal, window)
    q, k, v = (t.requires_grad_() for t in inputs(gen, 2, hq, hkv, nq, nk, d, torch.float16))
    decision = explain(q, k, v, causal=causal, window_size=window, softcap=cap, needs_grad=True, backend=backend)
    assert (decision.forward.backend, decision.backward.backend) == (backend, backend)
    assert decision.forward.variant.softcap and ".softcap" in decision.forward.variant.name
    out = attention(q, k, v, causal=causal, window_size=window, softcap=cap, backend=backend)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _, ref_grads = oracle(q, k, v, mask=mask, dout=dout, softcap=cap)
    peer, peer_grads = peer_error(q, k, v, mask=mask, dout=dout, softcap=cap)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, d ** -0.5, ulps)

"""Attention sinks (one learnable logit per query head in each row's softmax, no value: gpt-oss) in the Triton
forward (HAS_SINKS), in Triton's interpreter on CPU tensors, against fp64 math: every forward tile, with causal
masks (rows that see no key give 0 and LSE = the sink), windows and softcap; and the public call in fp16,
forward and backward, where the backward recomputes P from the LSE (which counts the sink) and dsinks comes
from the output. Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention, explain  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error  # noqa: E402

from .test_interpreter import FWD_TILES, feature_case_id, inputs, launch_window, module, tile_id  # noqa: E402

# (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap); causal with Nq > Nk hides every
# key from the first rows
CASES = [(4, 2, 113, 67, 32, True, (-1, -1), 0.0), (2, 2, 130, 130, 64, False, (-1, -1), 0.0),
         (2, 1, 67, 190, 32, False, (20, 5), 2.0)]


def sink_logits(gen, heads):
    return torch.randn(heads, generator=gen) * 2.0  # some above the rows' scores, some below


@pytest.mark.parametrize("tile", FWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=feature_case_id)
def test_forward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    sinks = sink_logits(gen, hq)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    module(tile).launch(q, k, v, out, lse, causal=causal, scale=0.3, window=launch_window(mask),
                        softcap=cap, sinks=sinks)
    ref, ref_lse, _ = oracle(q, k, v, mask=mask, scale=0.3, softcap=cap, sinks=sinks)
    peer, _ = peer_error(q, k, v, mask=mask, scale=0.3, softcap=cap, sinks=sinks)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    if causal and nq > nk:  # no key: output 0, LSE the sink's
        blind = nq - nk
        assert (out[:, :, :blind] == 0).all()
        assert torch.allclose(lse[:, :, :blind], sinks[None, :, None].expand(1, hq, blind))


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES, ids=feature_case_id)
def test_attention_fp16_forward_and_backward_with_dsinks(backend, case, gen):
    hq, hkv, nq, nk, d, causal, window, cap = case
    mask = _causal_mask(causal, window)
    q, k, v = (t.requires_grad_() for t in inputs(gen, 2, hq, hkv, nq, nk, d, torch.float16))
    sinks = sink_logits(gen, hq).requires_grad_()
    decision = explain(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=True, needs_grad=True,
                       backend=backend)
    assert (decision.forward.backend, decision.backward.backend) == (backend, backend)
    assert decision.forward.variant.sinks and "sinks" in decision.problem.describe()
    out, lse = attention(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=sinks, backend=backend,
                         return_lse=True)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, dout=dout, softcap=cap, sinks=sinks)
    peer, peer_grads = peer_error(q, k, v, mask=mask, dout=dout, softcap=cap, sinks=sinks)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    assert_grads_close(grads[:3], ref_grads[:3], peer_grads[:3], q, k, v, dout, mask, d ** -0.5, ulps)
    # dsinks is -sum over batch and rows of exp(sink - LSE) * rowsum(dO * O), from this call's own O (fp16) and LSE,
    # which are checked against fp64 above; so it is checked as that formula in fp64 on them, within fp32 rounding
    # of its sum (the rounding of O to fp16 reaches it through rowsum(dO * O), the same delta the dq/dk backward
    # uses; the fp16 peer computes dsinks another way, through softmax's backward, so its error is not this one's)
    share = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())
    want = -(share * (dout.double() * out.detach().double()).sum(-1)).sum((0, 2))
    assert_close("dsinks", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * nq))

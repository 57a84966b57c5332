"""Sliding windows in the Triton kernels (LOCAL), in Triton's interpreter on CPU tensors, against fp64 math:
every tile either Triton backend can pick, forward and backward, windows narrower and wider than a tile,
one-sided, causal, Nq != Nk both ways, rows the window hides every key from; and the public call in fp16.

Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py), like test_interpreter.py.
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention, explain  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error, sees  # noqa: E402

from .test_interpreter import BWD_TILES, FWD_TILES, inputs, module, tile_id  # noqa: E402

# (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window): windows of a few keys (inside one tile),
# wider than a tile on one side, bounded only on the left or the right, with GQA, odd lengths and Nq != Nk
# (with Nq > Nk and causal some rows see no key).
CASES = [(2, 1, 301, 257, 32, False, (37, 5)), (2, 2, 190, 190, 64, True, (70, -1)), (4, 2, 67, 300, 32, False, (-1, 20)),
         (2, 1, 260, 133, 32, True, (0, 0)), (1, 1, 129, 129, 16, False, (3, 3))]


def case_id(c):
    return f"{c[0]}x{c[1]}x{c[2]}x{c[3]}x{c[4]}{'-causal' if c[5] else ''}-w{c[6][0]}_{c[6][1]}"


@pytest.mark.parametrize("tile", FWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    out = torch.full_like(q, float("nan"))  # poisoned: unwritten elements show
    lse = torch.full(q.shape[:3], float("nan"))
    module(tile).launch(q, k, v, out, lse, causal=causal, scale=0.3, window=mask.window_bounds)
    ref, ref_lse, _ = oracle(q, k, v, mask=mask, scale=0.3)
    peer, _ = peer_error(q, k, v, mask=mask, scale=0.3)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    blind = ~sees(mask, nq, nk).any(-1)
    assert (out[:, :, blind] == 0).all() and (lse[:, :, blind] == float("-inf")).all()


@pytest.mark.parametrize("tile", BWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal, window = case
    mask = _causal_mask(causal, window)
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    dout = torch.randn(q.shape, generator=gen)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.3, dout=dout)
    _, peer_grads = peer_error(q, k, v, mask=mask, scale=0.3, dout=dout)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    module(tile).launch(q, k, v, ref.float(), ref_lse.float(), dout, *grads, causal=causal, scale=0.3,
                        window=mask.window_bounds)
    # as test_interpreter.py's backward: the fp32 LSE's own rounding on every recomputed P
    ulps = 4 * math.sqrt(max(nq, nk, d)) + ref_lse[torch.isfinite(ref_lse)].abs().max().item()
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, 0.3, ulps)


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_attention_fp16_forward_and_backward(backend, case, gen):
    """The public call forced to a Triton backend: the Decision names a LOCAL variant, fp16 against fp64."""
    hq, hkv, nq, nk, d, causal, window = case
    mask = _causal_mask(causal, window)
    q, k, v = (t.requires_grad_() for t in inputs(gen, 2, hq, hkv, nq, nk, d, torch.float16))
    decision = explain(q, k, v, causal=causal, window_size=window, needs_grad=True, backend=backend)
    assert decision.forward.backend == backend and decision.backward.backend == backend
    assert decision.forward.variant.local and decision.forward.variant.name.endswith(".local")
    out = attention(q, k, v, causal=causal, window_size=window, backend=backend)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _, ref_grads = oracle(q, k, v, mask=mask, dout=dout)
    peer, peer_grads = peer_error(q, k, v, mask=mask, dout=dout)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, d ** -0.5, ulps)


@pytest.mark.parametrize("tile", FWD_TILES + BWD_TILES, ids=lambda t: f"{t[1]}.{tile_id(t)}")
def test_keys_outside_every_window_are_never_loaded(tile, gen):
    """64 queries against 1000 keys with a window of 3 each side (bottom-right): the rows see keys 933..999, so
    with tiles of up to 128 keys every tile below key 896 is seen by no row. Those keys are NaN; a kernel that
    loaded them, even masked, would put NaN in the output (0 * NaN) or in dq. So a finite result equal to the
    oracle's (on finite keys there) shows those tiles are skipped, and their dk, dv are exactly 0."""
    nq, nk, window, unseen = 64, 1000, (3, 3), 896
    mask = _causal_mask(False, window)
    q, k, v = inputs(gen, 1, 2, 1, nq, nk, 32, torch.float32)
    dout = torch.randn(q.shape, generator=gen)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.3, dout=dout)
    k[:, :, :unseen] = float("nan")
    v[:, :, :unseen] = float("nan")
    if tile[1] == "fwd":
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"))
        module(tile).launch(q, k, v, out, lse, causal=False, scale=0.3, window=mask.window_bounds)
        assert torch.isfinite(out).all() and torch.allclose(out, ref.float(), atol=1e-5)
    else:
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        module(tile).launch(q, k, v, ref.float(), ref_lse.float(), dout, *grads, causal=False, scale=0.3,
                            window=mask.window_bounds)
        dq, dk, dv = grads
        assert torch.isfinite(dq).all() and torch.allclose(dq, ref_grads[0].float(), atol=1e-4)
        assert (dk[:, :, :unseen] == 0).all() and (dv[:, :, :unseen] == 0).all()
        assert torch.allclose(dk, ref_grads[1].float(), atol=1e-4) and torch.allclose(dv, ref_grads[2].float(), atol=1e-4)

"""The Triton backward with the LSE's gradient (dLSE folded into delta on the host), in Triton's interpreter
against fp64 math. Before, attention()'s LSE was non-differentiable and the kernels' launch took no dlse.
fp16 (the interpreter's bf16 dot is wrong, see test_interpreter.py); runs under TRITON_INTERPRET=1 only."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention  # noqa: E402
from attnforge.testing import assert_close, oracle, peer_error  # noqa: E402

# (backend, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal): odd lengths, GQA, a padded head dim (96),
# causal with seqlen_q > seqlen_k (rows that see no key: LSE -inf, their dlse has no effect).
CASES = [("triton_fa2", 2, 1, 37, 23, 32, True), ("triton_fa2", 4, 2, 17, 45, 96, False),
         ("triton_rocm", 2, 2, 29, 29, 32, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_gradients_through_out_and_lse_match_fp64(case, gen):
    backend, hq, hkv, nq, nk, d, causal = case
    q, k, v = (torch.randn(2, h, n, d, generator=gen).half().requires_grad_() for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    out, lse = attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    dout, dlse = torch.randn(out.shape, generator=gen).half(), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    _, _, ref = oracle(q, k, v, causal=causal, dout=dout, dlse=dlse)
    _, peer = peer_error(q, k, v, causal=causal, dout=dout, dlse=dlse.half())
    _, _, without = oracle(q, k, v, causal=causal, dout=dout)
    for name, g, r, p, w in zip(("dq", "dk", "dv"), grads, ref, peer, without):
        assert_close(name, g, r, p)
    assert (ref[0] - without[0]).abs().max() > 10 * (grads[0].double() - ref[0]).abs().max()  # dlse mattered
    if causal and nq > nk:
        assert (lse[:, :, :nq - nk] == float("-inf")).all() and grads[0][:, :, :nq - nk].eq(0).all()

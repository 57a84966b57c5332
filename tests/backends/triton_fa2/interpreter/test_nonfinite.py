"""triton_fa2's kernels in Triton's interpreter on non-finite inputs, and their double backward.

Runs in a pytest process of its own with TRITON_INTERPRET=1 (tests/backends/triton_fa2/test_interpreter_suite.py
starts it). fp16, as attention() serves the Triton backends (the interpreter's bf16 dot is wrong, see
test_interpreter.py).
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import BackendUnavailableError, attention  # noqa: E402
from attnforge.dispatch.mask import CAUSAL, NONE  # noqa: E402
from attnforge.testing import assert_nan_rows, oracle, peer_error, poison, sees  # noqa: E402

# (heads_q, heads_kv, seqlen_q, seqlen_k, causal): key tiles crossed, causal both ways (rows that see no key
# when seqlen_q > seqlen_k), GQA, no mask.
CASES = [(2, 1, 70, 150, True), (2, 2, 90, 37, True), (2, 1, 33, 70, False)]


# triton_rocm's forward leaves out the check of hidden non-finite values (templates/triton_rocm_fwd.py.jinja says
# why): a NaN value reaches other rows of its tile there.
BACKEND_TENSORS = [("triton_fa2", "q"), ("triton_fa2", "k"), ("triton_fa2", "v"), ("triton_rocm", "q"),
                   ("triton_rocm", "k")]


@pytest.mark.parametrize("backend,tensor", BACKEND_TENSORS, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_a_nan_gives_nan_output_and_lse_in_exactly_the_rows_that_see_it(case, tensor, backend, gen):
    """A NaN query row used to come out with a NaN output but LSE -inf (the LSE of a row that sees no key):
    the kernel took l > 0 for "saw a key", false for NaN. A NaN key reaches only the rows that see it (the
    scores are masked after the product). A NaN value row used to reach every row of its key tile through
    P @ V (0 * NaN), seen or not; now only the rows that see it (its LSE stays finite: values do not enter it).
    Rows that see no key still give 0 and LSE -inf."""
    hq, hkv, nq, nk, causal = case
    mask = CAUSAL if causal else NONE
    q, k, v = (torch.randn(1, h, n, 32, generator=gen).half() for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    visible = sees(mask, nq, nk)
    indices = [nq - 1] if tensor == "q" else sorted({0, nk - 1, int(visible.sum(0).argmin())})
    for index in indices:
        qn, kn, vn, rows = poison(q, k, v, tensor, index, mask)
        out, lse = attention(qn, kn, vn, causal=causal, scale=0.3, return_lse=True, backend=backend)
        ref, ref_lse, _ = oracle(qn, kn, vn, causal=causal, scale=0.3)
        peer, _ = peer_error(q, k, v, causal=causal, scale=0.3)
        assert_nan_rows("out", out, ref, peer, rows, ulps=32)
        assert_nan_rows("lse", lse, ref_lse, ref_lse.float(), rows if tensor != "v" else torch.zeros_like(rows),
                        ulps=32)
        blind = ~visible.any(-1)
        assert (out[:, :, blind] == 0).all() and (lse[:, :, blind] == float("-inf")).all()


def test_double_backward_is_a_clear_error(gen):
    q, k, v = (torch.randn(1, 2, 9, 32, generator=gen).half().requires_grad_() for _ in range(3))
    out = attention(q, k, v, causal=True, backend="triton_fa2")
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(BackendUnavailableError, match="second-order gradients .* backend 'triton_fa2'"):
        torch.autograd.grad(dq.sum(), v)

"""The reference backend (and the fp64 oracle it shares its mask with) on non-finite inputs and in
double backward: a NaN reaches exactly the rows that see it, never hidden as a masked row."""

import pytest
import torch

from attnforge import BackendUnavailableError, attention
from attnforge.api import _run
from attnforge.backends.reference import kernels, math_attention
from attnforge.dispatch.mask import CAUSAL, NONE, Mask
from attnforge.testing import assert_nan_rows, oracle, peer_error, poison, sees

# (seqlen_q, seqlen_k, mask): key tiles of 128 crossed, causal both ways (150 > 19 leaves rows that see no
# key), top-left causal (attnforge.sdpa's), no mask.
CASES = [(37, 37, CAUSAL), (19, 150, CAUSAL), (150, 19, CAUSAL), (23, 140, NONE),
         (40, 300, Mask(causal=True, top_left=True))]


def case_id(case):
    return f"{case[0]}x{case[1]}-{case[2].describe() or 'full'}"


def qkv(gen, nq, nk, hq=4, hkv=2, d=24, dtype=torch.float32):
    return (torch.randn(2, hq, nq, d, generator=gen).to(dtype), torch.randn(2, hkv, nk, d, generator=gen).to(dtype),
            torch.randn(2, hkv, nk, d, generator=gen).to(dtype))


def nan_indices(tensor, nq, nk, mask):
    """The last query row; or the first key, the last key some row sees (the mask hides it from the most
    rows) and the last key (top-left causal hides it from every row)."""
    if tensor == "q":
        return [nq - 1]
    seen = sees(mask, nq, nk).any(0).nonzero()
    return sorted({0, int(seen[-1]), nk - 1})


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_nan_reaches_exactly_the_rows_that_see_it(case, tensor, gen):
    """The online softmax keeps a NaN (a NaN query row used to come out as 0 with LSE -inf, a masked row's
    answer) and a NaN key or value reaches only the rows that see it (0 * NaN from a hidden value must not)."""
    nq, nk, mask = case
    q, k, v = qkv(gen, nq, nk)
    for index in nan_indices(tensor, nq, nk, mask):
        qn, kn, vn, rows = poison(q, k, v, tensor, index, mask)
        out, lse = kernels.forward(qn, kn, vn, mask=mask, scale=0.3)
        ref, ref_lse, _ = oracle(qn, kn, vn, mask=mask, scale=0.3)
        peer, _ = peer_error(q, k, v, mask=mask, scale=0.3)
        assert_nan_rows("out", out, ref, peer, rows, ulps=16)
        assert_nan_rows("lse", lse, ref_lse, ref_lse.float(), rows if tensor != "v" else torch.zeros_like(rows),
                        ulps=16)


def test_a_nan_in_one_value_column_stays_in_that_column(gen):
    q, k, v = qkv(gen, 19, 150)
    v[0, 0, 140, 5] = float("nan")
    out, _ = kernels.forward(q, k, v, mask=CAUSAL, scale=0.3)
    want = torch.zeros_like(out, dtype=torch.bool)
    want[0, :2, :, 5] = sees(CAUSAL, 19, 150)[:, 140]
    assert torch.equal(out.isnan(), want)
    assert torch.equal(math_attention(q.double(), k.double(), v.double(), causal=True, scale=0.3)[0].isnan(), want)


def test_infinite_values_reach_only_the_rows_that_see_them(gen):
    q, k, v = qkv(gen, 19, 150)
    v[0, 0, 140, 3], v[0, 0, 145, 3], v[0, 0, 145, 4] = float("inf"), float("-inf"), float("-inf")
    out, _ = kernels.forward(q, k, v, mask=CAUSAL, scale=0.3)
    ref, _ = math_attention(q.double(), k.double(), v.double(), causal=True, scale=0.3)
    visible = sees(CAUSAL, 19, 150)
    both = visible[:, 145]  # rows that see +inf and -inf in column 3: NaN; rows that see only +inf: +inf
    assert torch.equal(out[0, 0, :, 3].isnan(), both) and torch.equal(ref[0, 0, :, 3].isnan(), both)
    only_plus = visible[:, 140] & ~both
    assert (out[0, 0, only_plus, 3] == float("inf")).all() and (ref[0, 0, only_plus, 3] == float("inf")).all()
    assert (out[0, 0, both, 4] == float("-inf")).all()
    assert out[0, 0, ~visible[:, 140]].isfinite().all() and out[1:].isfinite().all()


def test_rows_that_see_no_key_still_give_zero_and_minus_infinity(gen):
    q, k, v = qkv(gen, 150, 19)
    q[0, 0, 0] = float("nan")  # a row that sees no key: its query is never used
    out, lse = attention(q, k, v, causal=True, return_lse=True, backend="reference")
    assert (out[:, :, :131] == 0).all() and (lse[:, :, :131] == float("-inf")).all()
    assert out[:, :, 131:].isfinite().all()


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_is_a_clear_error(causal, gen):
    """The reference backward is not differentiable by torch autograd: a second-order gradient used to come
    out silently wrong (gradgradcheck returned a 2x-off Jacobian); now it raises, saying what to use."""
    q, k, v = (t.double().requires_grad_() for t in qkv(gen, 7, 9, hq=2, hkv=1, d=8))
    with pytest.raises(BackendUnavailableError, match="second-order gradients .* backend 'reference'.*backend='sdpa'"):
        torch.autograd.gradgradcheck(lambda *x: attention(*x, causal=causal, backend="reference"), (q, k, v))
    out = attention(q, k, v, causal=causal, backend="reference")
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)  # create_graph alone is fine
    with pytest.raises(BackendUnavailableError, match="second-order gradients"):
        torch.autograd.grad(dq.sum(), k)


@pytest.mark.parametrize("mask", [CAUSAL, NONE, Mask(causal=True, top_left=True)], ids=lambda m: m.describe() or "full")
def test_gradcheck_through_lse(mask, gen):
    """(out, lse) are both differentiable: dLSE/dS = P folds into delta. The LSE's gradient used to be dropped
    (lse was marked non-differentiable), so gradcheck failed on the lse output."""
    q, k, v = (t.double().requires_grad_() for t in qkv(gen, 7, 9, hq=2, hkv=1, d=8))
    w_out, w_lse = torch.randn(2, 2, 7, 8, generator=gen).double(), torch.randn(2, 2, 7, generator=gen).double()

    def loss(q, k, v):  # one output that needs both terms (gradcheck skips an output that needs no grad)
        out, lse = _run(q, k, v, mask, 0.3, 0.0, "bhsd", True, "reference")  # attention()'s path, any Mask
        return (out * w_out).sum() + (lse * w_lse).sum()

    torch.autograd.gradcheck(loss, (q, k, v))


def test_lse_gradient_of_rows_that_see_no_key_has_no_effect(gen):
    """Rows with LSE -inf have P = 0: a dlse there changes nothing and brings no NaN; the other rows' dlse counts."""
    q, k, v = (t.double().requires_grad_() for t in qkv(gen, 150, 19, hq=2, hkv=1, d=8))
    out, lse = attention(q, k, v, causal=True, return_lse=True, backend="reference")
    dead = lse == float("-inf")
    assert dead.any() and not dead.all()
    dout, dlse = torch.randn(out.shape, generator=gen).double(), torch.randn(lse.shape, generator=gen).double()
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = math_attention(q64, k64, v64, causal=True)
    want = torch.autograd.grad((ref_out, ref_lse), (q64, k64, v64), (dout, dlse), retain_graph=True)
    no_lse = torch.autograd.grad((ref_out, ref_lse), (q64, k64, v64), (dout, torch.zeros_like(dlse)))
    for g, w in zip(grads, want):
        assert g.isfinite().all()
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(want[0], no_lse[0])  # the live rows' dlse changes dq: the check above can fail

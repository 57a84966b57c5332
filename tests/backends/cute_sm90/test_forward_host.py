"""The host side of cute_sm90's forward, on CPU: the output allocations its kernels rely on, and the
sign of the scale they are given."""

import pytest
import torch

from attnforge.backends.cute_sm90.backend import _lse_prototype, nonnegative_scale


def test_lse_allocated_from_the_prototype_is_dense_fp32():
    """The kernel writes the LSE row by row with unit stride: an expanded (stride-0) or strided tensor
    would lose rows."""
    shape = torch.Size((2, 3, 17))
    lse = torch.empty_like(_lse_prototype(shape, torch.device("cpu")))
    assert lse.shape == shape and lse.dtype == torch.float32 and lse.stride() == (51, 17, 1)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn))
@pytest.mark.parametrize("scale", (-0.7, -0.0, 0.0, 0.3))
def test_a_negative_scale_becomes_a_negated_q(dtype, scale, gen):
    """The kernels bound their exponentials by each row's max of the unscaled scores, right only for a
    scale >= 0: a negative one reaches them as (-q, -scale), the same scores, with q negated exactly."""
    q, k = (torch.randn(2, 3, 17, 64, generator=gen).to(dtype) for _ in range(2))
    q2, scale2 = nonnegative_scale(q, scale)
    assert scale2 >= 0 and scale2 == abs(scale) and q2.dtype == dtype
    if scale >= 0:
        assert q2 is q
    else:
        assert torch.equal(q2.float(), -q.float())
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    assert torch.equal(scores, (q2.double() @ k.double().transpose(-1, -2)) * scale2)

"""backends/shared/inputs.py: input preparations the backends share."""

import pytest
import torch

from attnforge.backends.shared.inputs import TINY_SCALE, nonnegative_scale


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn))
@pytest.mark.parametrize("scale", (-0.7, -1e-40, -0.0, 0.0, 1e-60, 0.3))
def test_a_negative_scale_becomes_a_negated_q(dtype, scale, gen):
    """Kernels that bound their exponentials by each row's max of the unscaled scores are right only
    for a scale >= 0: a negative one reaches them as (-q, -scale), the same scores, with q negated exactly.
    A scale below TINY_SCALE in magnitude (0 included: 0 * a masked -inf is NaN) is folded into 16-bit q
    (q * scale, scale 1: the same scores); FP8 q keeps it (the FP8 kernels' host code bounds it)."""
    q, k = (torch.randn(2, 3, 17, 64, generator=gen).to(dtype) for _ in range(2))
    q2, scale2 = nonnegative_scale(q, scale)
    assert scale2 >= 0 and q2.dtype == dtype
    if abs(scale) < TINY_SCALE and dtype != torch.float8_e4m3fn:
        assert scale2 == 1.0 and torch.equal(q2, q * scale)
        return
    assert scale2 == abs(scale)
    if scale >= 0:
        assert q2 is q
    else:
        assert torch.equal(q2.float(), -q.float())
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    assert torch.equal(scores, (q2.double() @ k.double().transpose(-1, -2)) * scale2)

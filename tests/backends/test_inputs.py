"""backends/shared/inputs.py: input preparations the backends share."""

import pytest
import torch

from attnforge.backends.shared.inputs import nonnegative_scale


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn))
@pytest.mark.parametrize("scale", (-0.7, -0.0, 0.0, 0.3))
def test_a_negative_scale_becomes_a_negated_q(dtype, scale, gen):
    """Kernels that bound their exponentials by each row's max of the unscaled scores are right only
    for a scale >= 0: a negative one reaches them as (-q, -scale), the same scores, with q negated exactly."""
    q, k = (torch.randn(2, 3, 17, 64, generator=gen).to(dtype) for _ in range(2))
    q2, scale2 = nonnegative_scale(q, scale)
    assert scale2 >= 0 and scale2 == abs(scale) and q2.dtype == dtype
    if scale >= 0:
        assert q2 is q
    else:
        assert torch.equal(q2.float(), -q.float())
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    assert torch.equal(scores, (q2.double() @ k.double().transpose(-1, -2)) * scale2)

"""The Triton V^T kernel (backends/cute_sm90/v_layout.py) in Triton's interpreter on CPU, against the
torch version byte for byte, on a poisoned output. Run by ../test_v_layout.py with TRITON_INTERPRET=1."""

import pytest
import torch

from attnforge.backends.cute_sm90 import v_layout


@pytest.mark.parametrize("seqlen", (1, 17, 113))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("strided", (False, True), ids=("contiguous", "bshd-view"))
def test_triton_kernel_matches_torch(seqlen, head_dim, strided, gen):
    v = torch.randn(2, seqlen, 3, head_dim, generator=gen).to(torch.float8_e4m3fn).transpose(1, 2)
    if not strided:
        v = v.contiguous()
    want = v_layout.prepare_v_fp8_torch(v).view(torch.uint8)
    poisoned = torch.full(want.shape, 0x7F, dtype=torch.uint8)  # e4m3 NaN
    got = v_layout.prepare_v_fp8(v, use_triton=True, out=poisoned)
    assert torch.equal(got.view(torch.uint8), want)

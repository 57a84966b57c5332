"""The host side of cute_sm90's forward, on CPU: the output allocations its kernels rely on."""

import torch

from attnforge.backends.cute_sm90.backend import _lse_prototype


def test_lse_allocated_from_the_prototype_is_dense_fp32_of_its_own():
    shape = torch.Size((2, 3, 17))
    a = torch.empty_like(_lse_prototype(shape, torch.device("cpu")))
    b = torch.empty_like(_lse_prototype(shape, torch.device("cpu")))
    assert a.shape == shape and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()  # fresh storage each call, not the 1-element prototype's
    a.fill_(1.0)
    assert not torch.equal(a, b.fill_(2.0))

"""The host side of cute_sm90's forward, on CPU: the output allocations its kernels rely on."""

import torch

from attnforge.backends.cute_sm90.backend import _lse_prototype


def test_lse_allocated_from_the_prototype_is_dense_fp32():
    """The kernel writes the LSE row by row with unit stride: an expanded (stride-0) or strided tensor
    would lose rows."""
    shape = torch.Size((2, 3, 17))
    lse = torch.empty_like(_lse_prototype(shape, torch.device("cpu")))
    assert lse.shape == shape and lse.dtype == torch.float32 and lse.stride() == (51, 17, 1)

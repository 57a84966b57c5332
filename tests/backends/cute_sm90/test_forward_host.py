"""The host side of cute_sm90's forward, on CPU: the output allocations its kernels rely on."""

import torch

from attnforge.backends.shared.cute_host import lse_like


def test_lse_allocated_from_the_prototype_is_dense_fp32():
    """The kernel writes the LSE row by row with unit stride: an expanded (stride-0) or strided tensor
    would lose rows. Twice: the second allocation comes from the cached prototype, and must be a fresh
    tensor, not the first one again."""
    shape = torch.Size((2, 3, 17))
    first = lse_like(shape, torch.device("cpu"))
    lse = lse_like(shape, torch.device("cpu"))
    assert lse.shape == shape and lse.dtype == torch.float32 and lse.stride() == (51, 17, 1)
    assert lse.data_ptr() != first.data_ptr()

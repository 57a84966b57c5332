"""Input preparations several backends share."""

from __future__ import annotations

import torch


def nonnegative_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with scale >= 0. The CuTe kernels take each row's max over unscaled scores, which
    bounds the exponentials only for a scale that is not negative, and PyTorch's CPU flash SDPA returns
    NaN for a causal call with a negative scale (torch 2.13). softmax(q k^T s) = softmax((-q) k^T (-s)), so
    a negative scale negates q instead (a copy, exact in every dtype: e4m3 by its sign bit; differentiable).
    FP8's descales are taken to be positive (they are quantisation scales)."""
    if scale >= 0:
        return q, scale
    if q.dtype == torch.float8_e4m3fn:
        return torch.bitwise_xor(q.view(torch.uint8), 0x80).view(q.dtype), -scale
    return torch.neg(q), -scale

"""Input preparations several backends share."""

from __future__ import annotations

import torch

# Below this softmax scale every score q.k * scale of finite inputs is far below fp32's rounding of the
# exponent offsets (|q.k| < 2^79 gives |score| < 2^-21): the scores are 0 to fp32, and kernels that multiply
# a masked -inf by the scale (torch's CPU SDPA with causal) make NaN of an exact 0 or of a scale that is 0 in
# fp32. Folded into q (q * scale, then scale 1) the scores stay what they are, masks stay -inf and a NaN in q
# stays NaN.
TINY_SCALE = 2.0 ** -100


def nonnegative_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with scale >= TINY_SCALE, or 16-bit/fp32 q with a smaller scale folded in (q * scale,
    scale 1; a copy, exact math; FP8 keeps its tiny scale: the FP8 kernels' host code bounds the product of
    scale and descales, see cute_sm90's backend). The CuTe kernels take each row's max over unscaled scores,
    which bounds the exponentials only for a scale that is not negative, and PyTorch's CPU flash SDPA returns
    NaN for a causal call with a negative scale (torch 2.13). softmax(q k^T s) = softmax((-q) k^T (-s)), so
    a negative scale negates q instead (a copy, exact in every dtype: e4m3 by its sign bit; differentiable).
    FP8's descales are taken to be positive (they are quantisation scales)."""
    if scale >= TINY_SCALE:
        return q, scale
    if q.dtype == torch.float8_e4m3fn:
        if scale >= 0:
            return q, scale
        return torch.bitwise_xor(q.view(torch.uint8), 0x80).view(q.dtype), -scale
    if scale > -TINY_SCALE:
        return q * scale, 1.0
    return torch.neg(q), -scale

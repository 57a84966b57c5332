"""cute_sm90's FP8 score scale on the host (score_descale), checked on the CPU against the FP8 kernel's
softmax written in torch as templates/cute_sm90_fwd.py.jinja computes it. The kernel itself runs in
tests/backends/cute_sm90/test_gpu.py (test_fp8_zero_descales_match_fp64_on_the_dequantised_inputs)."""

import math

import pytest
import torch

from attnforge.backends.cute_sm90.backend import score_descale
from attnforge.testing import oracle, sees
from attnforge.dispatch.mask import CAUSAL, NONE

P_EXPONENT_BIAS = 8.0  # the template's: P is 2^8 at the row max


def kernel_softmax(q8, k8, v8, descale, scale_log2, causal):
    """The kernel's online softmax in one block (with a masked key tail, as seqlen_k is not a multiple of the
    kernel's key block): unscaled e4m3 scores masked to -inf, row max over them,
    P = exp2(S * e - (max * e - 8)) with e = scale_log2 * q_descale * k_descale, out = P @ V / sum(P) * v_descale
    (0 where the sum is 0), LSE = (max * e + log2(sum) - 8) * ln 2 (-inf there)."""
    s = q8.float() @ k8.float().transpose(-1, -2)
    visible = sees(CAUSAL if causal else NONE, q8.shape[2], k8.shape[2])
    s = s.masked_fill(~visible, float("-inf"))
    s = torch.nn.functional.pad(s, (0, 11), value=float("-inf"))  # the key tail of the last block, masked too
    v8 = torch.nn.functional.pad(v8.float(), (0, 0, 0, 11))
    e = (torch.tensor(scale_log2, dtype=torch.float32) * descale[0] * descale[1])[:, :, None, None]
    row_max = s.amax(-1, keepdim=True)
    safe = torch.where(row_max == float("-inf"), 0.0, row_max)
    p = torch.exp2(s * e - (safe * e - P_EXPONENT_BIAS))
    total = p.sum(-1, keepdim=True)
    inv = torch.where(total > 0, 1 / total, 0.0) * descale[2][:, :, None, None]
    lse = torch.where(total > 0, (safe * e + torch.log2(total) - P_EXPONENT_BIAS) * math.log(2), float("-inf"))
    return (p @ v8.float()) * inv, lse.squeeze(-1)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_descales_and_scale_give_attention_of_the_dequantised_inputs(causal, gen):
    b, h, nq, nk, d = 2, 2, 37, 53, 32
    q8, k8, v8 = (torch.randn(b, h, n, d, generator=gen).to(torch.float8_e4m3fn) for n in (nq, nk, nk))
    descale = torch.rand(3, b, h, generator=gen) + 0.5
    descale[0, 0, 0] = 0.0  # q descale 0: every score 0, uniform over the visible keys
    descale[1, 0, 1] = 0.0  # k descale 0: the same
    descale[2, 1, 0] = 0.0  # v descale 0: output 0
    scale_log2 = d ** -0.5 * math.log2(math.e)
    out, _ = kernel_softmax(q8, k8, v8, descale, scale_log2, causal)
    assert out[0].isnan().any()  # what the kernel computed with the descales as given (-inf * 0)
    fixed, fixed_scale = score_descale(descale, scale_log2)
    out, lse = kernel_softmax(q8, k8, v8, fixed, fixed_scale, causal)
    deq = [t.double() * s[:, :, None, None].double() for t, s in zip((q8, k8, v8), descale)]
    ref, ref_lse, _ = oracle(*deq, causal=causal)
    assert out.isfinite().all() and (out[1, 0] == 0).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    # with the scale itself 0 every (b, head) is uniform; a NaN descale stays NaN
    descale[0, 1, 1] = float("nan")
    out, _ = kernel_softmax(q8, k8, v8, *score_descale(descale, 0.0), causal)
    ref, _, _ = oracle(*deq, causal=causal, scale=0.0)
    assert out[1, 1].isnan().all() and out[:, :1].isfinite().all() and out[0].isfinite().all()
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-5, atol=1e-5)

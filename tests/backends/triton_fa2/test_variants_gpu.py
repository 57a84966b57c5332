"""triton_fa2's feature kernels (sliding window, softcap, sinks, ALiBi, alone and combined) on an NVIDIA GPU,
through attention() in bf16 and fp16, forward and backward, against fp64 math: odd lengths, Nq != Nk, GQA, causal,
rows that see no key. Outputs and gradients are NaN-filled before the run (poisoned_empty), so an element no CTA
writes shows."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

# (seqlen_q, seqlen_k, heads_q, heads_kv, causal, window, softcap, sinks, alibi)
CASES = [
    (1023, 1023, 8, 2, True, (255, -1), 0.0, False, False),   # the Mistral shape: causal + left window
    (113, 1023, 4, 4, False, (17, 17), 0.0, False, False),     # two-sided window, Nq < Nk (bottom-right)
    (1023, 113, 4, 1, False, (5, 0), 0.0, False, False),      # Nq > Nk: the first rows see no key
    (1023, 1023, 8, 2, True, (-1, -1), 30.0, False, False),   # Gemma 2's softcap
    (1023, 1023, 8, 8, True, (-1, -1), 0.0, True, False),     # gpt-oss's sinks
    (113, 1023, 8, 2, False, (-1, -1), 0.0, False, True),     # ALiBi
    (1023, 1023, 8, 2, True, (127, -1), 50.0, True, True),    # all four
    (1, 4099, 8, 2, True, (1023, -1), 30.0, True, False),     # one query row (decode-shaped prefill)
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_features_on_the_gpu_match_fp64(case, head_dim, dtype, gen, poisoned_empty):
    nq, nk, hq, hkv, causal, window, cap, with_sinks, with_alibi = case
    q = torch.randn(2, hq, nq, head_dim, generator=gen).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, hkv, nk, head_dim, generator=gen).to("cuda", dtype).requires_grad_() for _ in range(2))
    sinks = (torch.randn(hq, generator=gen) * 2).cuda().requires_grad_() if with_sinks else None
    slopes = (torch.rand(2, hq, generator=gen) * 0.1).cuda() if with_alibi else None
    out, lse = attnforge.attention(q, k, v, causal=causal, window_size=window, softcap=cap, sinks=sinks,
                                   alibi_slopes=slopes, return_lse=True, backend="triton_fa2")
    assert attnforge.last_decision().forward.backend == "triton_fa2"
    dout = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad(out, inputs, dout)
    for name, t in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads)):
        assert not t.isnan().any(), f"{name}: NaN (an unwritten element, or a wrong one)"
    mask = _causal_mask(causal, window)
    scale = head_dim ** -0.5
    features = dict(mask=mask, scale=scale, softcap=cap, sinks=sinks, alibi_slopes=slopes, dout=dout)
    ref, ref_lse, ref_grads = oracle(q, k, v, **features)
    peer, peer_grads = peer_error(q, k, v, **features)
    ulps = 4 * math.sqrt(max(nq, nk, head_dim))
    assert_close("out", out, ref, peer, ulps=ulps)
    finite = ref_lse.isfinite()
    assert torch.equal(lse[~finite], ref_lse[~finite].float()), "rows that see no key have LSE -inf"
    assert_close("lse", lse[finite], ref_lse[finite], ref_lse[finite].float(), ulps=ulps)
    assert_grads_close(grads[:3], ref_grads[:3], peer_grads[:3], q, k, v, dout, mask, scale, 2 * ulps)
    if sinks is not None:
        # dsinks = -sum over batch and rows of exp(sink - LSE) * rowsum(dO * O), from this call's own O and LSE
        # (checked above), as the interpreter tests check it: that formula in fp64 on them, within fp32 rounding of
        # the sum (the bf16 peer differentiates through softmax instead, so its error is not this one's)
        share = torch.exp(sinks.detach().double()[None, :, None] - lse.detach().double())
        want = -(share * (dout.double() * out.detach().double()).sum(-1)).sum((0, 2))
        assert_close("dsinks", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * nq))

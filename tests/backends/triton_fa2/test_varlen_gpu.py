"""The VARLEN kernels on an NVIDIA GPU, through attention_varlen in bf16 and fp16, forward and backward, against fp64
math per sequence: every head dim of the forward table, mixed lengths (0, 1, 17, 113, 1023, 4099) with Nq != Nk per
sequence, GQA, causal, windows, softcap and sinks. Outputs and gradients are NaN-filled before the run
(poisoned_empty), so a row no CTA writes shows."""

import math

import pytest
import torch

import attnforge
from attnforge.api import _causal_mask
from attnforge.backends.triton_fa2 import variants
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

LENGTHS_Q = [17, 0, 1, 1023, 113, 4099]
LENGTHS_K = [17, 9, 0, 1023, 4099, 113]
HEAD_DIMS = sorted(variants.FWD["sm90"])

# (heads_q, heads_kv, causal, window, softcap, sinks)
CASES = [(8, 2, True, (-1, -1), 0.0, False), (4, 4, False, (-1, -1), 0.0, False),
         (8, 1, True, (255, -1), 30.0, True)]


def packed(gen, heads, heads_kv, d, dtype):
    q = torch.randn(sum(LENGTHS_Q), heads, d, generator=gen).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(sum(LENGTHS_K), heads_kv, d, generator=gen).to("cuda", dtype).requires_grad_()
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (LENGTHS_Q, LENGTHS_K))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_on_the_gpu(case, head_dim, dtype, gen, poisoned_empty):
    hq, hkv, causal, window, cap, with_sinks = case
    q, k, v, cu_q, cu_k = packed(gen, hq, hkv, head_dim, dtype)
    sinks = (torch.randn(hq, generator=gen) * 2).cuda() if with_sinks else None
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                          window_size=window, softcap=cap, sinks=sinks, return_lse=True,
                                          backend="triton_fa2")
    assert attnforge.last_decision().forward.variant.varlen
    dout = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name}: NaN (an unwritten row, or a wrong one)"
    mask = _causal_mask(causal, window)
    scale = head_dim ** -0.5
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            assert (out[rows] == 0).all() and (dk[keys] == 0).all() and (dv[keys] == 0).all()
            continue
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys], dout[rows])]
        ref, ref_lse, ref_grads = oracle(*bhsd[:3], mask=mask, scale=scale, softcap=cap, sinks=sinks, dout=bhsd[3])
        peer, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=scale, softcap=cap, sinks=sinks, dout=bhsd[3])
        ulps = 4 * math.sqrt(max(rows.stop - rows.start, keys.stop - keys.start, head_dim))
        assert_close(f"out[{b}]", out[rows].transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close(f"lse[{b}]", lse[:, rows].unsqueeze(0), ref_lse, ref_lse.float(), ulps=ulps)
        grads = [g.transpose(0, 1).unsqueeze(0) for g in (dq[rows], dk[keys], dv[keys])]
        assert_grads_close(grads, ref_grads[:3], peer_grads[:3], *bhsd, mask, scale, 2 * ulps)


def test_automatic_dispatch_takes_the_varlen_kernel(gen):
    q, k, v, cu_q, cu_k = packed(gen, 8, 2, 128, torch.bfloat16)
    attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=True)
    d = attnforge.last_decision()
    # (on sm90 both are cute_sm90's packed kernels: tests/backends/cute_sm90/test_gpu_varlen.py)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert d.forward.variant.varlen and d.backward.variant.varlen
    assert d.backward.backend == ("cute_sm90" if hopper else "triton_fa2"), d

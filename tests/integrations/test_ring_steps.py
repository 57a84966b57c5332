"""What torch's context parallelism asks of attnforge's kernels, simulated in one process: the keys in chunks
(a ring's steps), each step a call of the function attnforge installs for ``aten::_scaled_dot_product_flash_attention``
(non-causal with seqlen_q != seqlen_k, or causal on the diagonal chunk, top-left as torch's ``is_causal``),
the steps merged by their LSE (``merge_states``), and each step's backward run from the *merged* output and LSE,
as the ring's backward does. Forward and the summed gradients must equal full attention's (fp64 math); and
through ``attention(return_lse=True)`` plus ``merge_states``, autograd gives the same gradients. On the CPU here,
and on a GPU where there is one (the fast kernels then serve the steps)."""

import math

import pytest
import torch

import attnforge
from attnforge.dispatch.mask import CAUSAL, NONE
from attnforge.integrations import torch_flash
from attnforge.testing import assert_close, oracle, peer_error

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def chunked(gen, device, dtype, lengths=(17, 40, 23), heads=4, heads_kv=2, dim=32):
    n = sum(lengths)

    def rand(h):
        return torch.randn(2, h, n, dim, generator=gen).to(device=device, dtype=dtype)
    return rand(heads), rand(heads_kv), rand(heads_kv), list(lengths)


def ring(q, k, v, lengths, causal, dout):
    """Each query chunk against every key chunk it sees (the ring's steps), merged by LSE; then each step's
    backward from the merged out and LSE. Returns (out, lse, dq, dk, dv)."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    chunks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    outs, lses, dq = [], [], torch.zeros_like(q, dtype=torch.float32)
    dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v))
    for r, qs in enumerate(chunks):
        steps = [(j, ks) for j, ks in enumerate(chunks) if not causal or j <= r]  # later chunks are hidden
        parts = [torch_flash.sdpa_flash_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], is_causal=causal and j == r,
                                                scale=0.2)[:2] for j, ks in steps]
        out, lse = attnforge.merge_states([o for o, _ in parts], [l for _, l in parts])
        for j, ks in steps:
            g = torch_flash.sdpa_flash_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out, lse, None,
                                                None, 0, 0, 0.0, causal and j == r, None, None, scale=0.2)
            dq[:, :, qs] += g[0]
            dk[:, :, ks] += g[1]
            dv[:, :, ks] += g[2]
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2), dq, dk, dv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_a_simulated_ring_equals_full_attention(device, causal, gen):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, lengths = chunked(gen, device, dtype)
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    out, lse, dq, dk, dv = ring(q, k, v, lengths, causal, dout)
    mask = CAUSAL if causal else NONE  # square overall: bottom-right and top-left agree
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.2, dout=dout)
    peer, peer_grads = peer_error(q, k, v, mask=mask, scale=0.2, dout=dout)
    ulps = 4 * math.sqrt(max(q.shape[2], q.shape[3]))  # as tests/test_api.py
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    # the steps' gradients are summed in fp32: compare at the inputs' dtype, as a kernel's own would be
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, peer_grads):
        assert_close(name, g.to(dtype), r, p, ulps=ulps)


@pytest.mark.parametrize("device", DEVICES)
def test_merging_differentiable_lses_gives_full_attentions_gradients(device, gen):
    """The other way CP and cascades differentiate: attention(return_lse=True) per key chunk, merge_states,
    autograd through both outputs."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v, lengths = chunked(gen, device, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    parts = [attnforge.attention(q, k[:, :, a:b], v[:, :, a:b], scale=0.2, return_lse=True)
             for a, b in zip(bounds, bounds[1:])]
    out, lse = attnforge.merge_states([o for o, _ in parts], [l for _, l in parts])
    dout, dlse = (torch.randn(t.shape, generator=gen).to(device=device, dtype=t.dtype) for t in (out, lse))
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref, ref_lse, ref_grads = oracle(q, k, v, scale=0.2, dout=dout, dlse=dlse)
    peer, peer_grads = peer_error(q, k, v, scale=0.2, dout=dout, dlse=dlse.to(q.dtype))
    ulps = 4 * math.sqrt(max(q.shape[2], q.shape[3]))
    assert_close("out", out, ref, peer, ulps=ulps)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert_close(name, g, r, p, ulps=ulps)

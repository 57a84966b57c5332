"""attention_varlen: packed (total_tokens, heads, dim) batches delimited by int32 cu_seqlens, FlashAttention's
layout, against fp64 math on each sequence alone: odd and zero lengths, Nq != Nk per sequence, GQA, causal
(bottom-right per sequence), windows, the LSE (heads, total_q), gradients; bad offsets are named."""

import math

import pytest
import torch

import attnforge
from attnforge import InvalidInputError
from attnforge.api import _causal_mask
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error

LENGTHS_Q = [17, 0, 1, 40, 113]
LENGTHS_K = [23, 5, 0, 40, 1]


def packed(gen, lengths_q, lengths_k, heads=4, heads_kv=2, dim=16, dtype=torch.float32):
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen, dtype=dtype).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), heads_kv, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def per_sequence(t, cu):
    bounds = cu.tolist()
    return [t[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)), (True, (5, -1))])
def test_matches_each_sequence_alone(backend, causal, window, gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                          scale=0.3, window_size=window, return_lse=True, backend=backend)
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = _causal_mask(causal, window)
    ulps = 4 * math.sqrt(113)
    for qs, ks, vs, os_, ls, ds, dqs, dks, dvs in zip(*(per_sequence(t, cu_q) for t in (q,)),
                                                        per_sequence(k, cu_k), per_sequence(v, cu_k),
                                                        per_sequence(out, cu_q), per_sequence(lse.T, cu_q),
                                                        per_sequence(dout, cu_q), per_sequence(grads[0], cu_q),
                                                        per_sequence(grads[1], cu_k), per_sequence(grads[2], cu_k)):
        if qs.shape[0] == 0:
            continue
        if ks.shape[0] == 0:  # no key: 0 and -inf, no gradient
            assert (os_ == 0).all() and (ls == float("-inf")).all() and (dqs == 0).all()
            continue
        bhsd = [t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs, ds)]
        ref, ref_lse, ref_grads = oracle(*bhsd[:3], mask=mask, scale=0.3, dout=bhsd[3])
        peer, peer_grads = peer_error(*bhsd[:3], mask=mask, scale=0.3, dout=bhsd[3])
        assert_close("out", os_.transpose(0, 1).unsqueeze(0), ref, peer, ulps=ulps)
        assert_close("lse", ls.T.unsqueeze(0), ref_lse, ref_lse.float(), ulps=ulps)
        assert_grads_close([g.transpose(0, 1).unsqueeze(0) for g in (dqs, dks, dvs)], ref_grads, peer_grads,
                           *bhsd, mask, 0.3, ulps)


def test_every_sequence_empty_of_queries(gen):
    q, k, v, cu_q, cu_k = packed(gen, [0, 0], [3, 4])
    out, lse = attnforge.attention_varlen(q, k, v, cu_q, cu_k, 0, 4, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cu_q=a["cu_q"].long()), "cu_seqlens_q must be a 1-D int32 tensor"),
    (lambda a: a.update(cu_k=torch.tensor([0, 30, 20, 69, 69, 70], dtype=torch.int32)), "without decreasing"),
    (lambda a: a.update(cu_q=torch.tensor([0, 17, 18, 58, 171], dtype=torch.int32)), "cu_seqlens_q has 4 sequences"),
    (lambda a: a.update(cu_k=torch.tensor([1, 23, 28, 28, 68, 69], dtype=torch.int32)), "from 0 to the packed length"),
    (lambda a: a.update(max_q=112), "max_seqlen_q must be an int at least the longest sequence \\(113\\)"),
    (lambda a: a.update(q=a["q"][None]), "q must be a \\(total_tokens, heads, head_dim\\) tensor"),
])
def test_bad_inputs_are_named(change, match, gen):
    q, k, v, cu_q, cu_k = packed(gen, LENGTHS_Q, LENGTHS_K)
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=113, max_k=40)
    change(args)
    with pytest.raises(InvalidInputError, match=match):
        attnforge.attention_varlen(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"],
                                   args["max_k"])

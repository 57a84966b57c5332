"""The VARLEN kernels (attention_varlen's packed batches: one launch, each CTA finding its sequence's rows through
cu_seqlens) of both Triton backends in Triton's interpreter on CPU tensors, against fp64 math on each sequence
alone: every VARLEN tile launched directly on poisoned outputs and gradients in fp32, and the public call in fp16,
forward and backward, with zero-length and one-token sequences, Nq != Nk per sequence, GQA, causal, windows,
softcap, sinks and ALiBi. Runs with TRITON_INTERPRET=1 in its own process (test_interpreter_suite.py)."""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention_varlen, last_decision  # noqa: E402
from attnforge.api import _causal_mask  # noqa: E402
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error  # noqa: E402

from .test_interpreter import BACKENDS, tile_id  # noqa: E402

# Per-sequence lengths: a zero-length query side, a sequence with no key (its rows give 0 and LSE -inf), one
# token, Nq < Nk and Nq > Nk (causal hides every key from its first rows), tile edges crossed.
LENGTHS_Q = [17, 0, 1, 70, 5, 33]
LENGTHS_K = [40, 6, 0, 70, 1, 129]
VARLEN_FWD = list(dict.fromkeys((b, v.tile) for b in BACKENDS for v in b.variants(features=(frozenset({"varlen"}),))
                                if v.varlen and v.family == "fwd"))
VARLEN_BWD = list(dict.fromkeys((b, v.tile) for b in BACKENDS for v in b.variants(features=(frozenset({"varlen"}),))
                                if v.varlen and v.family == "bwd"))


def varlen_tile_id(entry):
    return tile_id((entry[0], None, entry[1]))


def packed(gen, heads, heads_kv, dim, dtype, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lengths_k), heads_kv, dim, generator=gen).to(dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


def sequences(cu_q, cu_k):
    """(sequence index, query rows, key rows) of each sequence."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [(b, slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])) for b in range(len(bq) - 1)]


def bhsd(t):
    """A sequence's (rows, heads, dim) slice as the (1, heads, rows, dim) tensor fp64 math takes."""
    return t.transpose(0, 1).unsqueeze(0)


def module(backend, family, tile):
    from attnforge.codegen import Source
    from attnforge.runtime import generated

    return generated.load(Source.of(backend.templates[family], tile.params(), tile.module))


def check_forward(out, lse, q, k, v, cu_q, cu_k, mask, scale, ulps, **features):
    """out (total_q, heads, dv) and lse (heads, total_q) against fp64 math per sequence; a sequence with no key
    gives 0 and LSE -inf (or the sink's)."""
    slopes = features.pop("alibi_slopes", None)
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start:
            continue
        o, s = bhsd(out[rows]), lse[:, rows].unsqueeze(0)
        assert not o.isnan().any() and not s.isnan().any(), f"sequence {b}: unwritten (NaN) rows"
        if keys.stop == keys.start:
            assert (o == 0).all(), f"sequence {b} sees no key: its rows must be 0"
            sinks = features.get("sinks")
            want = float("-inf") if sinks is None else sinks[None, :, None].expand_as(s)
            assert torch.equal(s, torch.full_like(s, float("-inf"))) if sinks is None else torch.allclose(s, want)
            continue
        one = dict(features, alibi_slopes=None if slopes is None else slopes[b:b + 1])
        args = (bhsd(q[rows]), bhsd(k[keys]), bhsd(v[keys]))
        ref, ref_lse, _ = oracle(*args, mask=mask, scale=scale, **one)
        peer, _ = peer_error(*args, mask=mask, scale=scale, **one)
        assert_close(f"out of sequence {b}", o, ref, peer, ulps=ulps)
        assert_close(f"lse of sequence {b}", s, ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("entry", VARLEN_FWD, ids=varlen_tile_id)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (20, 3))])
def test_forward_fp32_every_varlen_tile(entry, causal, window, gen):
    """One launch over the packed batch, outputs and LSE poisoned: every row of every sequence is written."""
    backend, tile = entry
    q, k, v, cu_q, cu_k = packed(gen, 4, 2, 32, torch.float32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"))
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)]
    module(backend, "fwd", tile).launch(*views, lse.unsqueeze(0), causal=causal, scale=0.3, window=window,
                                        varlen=(cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K)))
    mask = _causal_mask(causal, window or (-1, -1))
    check_forward(out, lse, q, k, v, cu_q, cu_k, mask, 0.3, 4 * math.sqrt(max(LENGTHS_K)))


@pytest.mark.parametrize("entry", VARLEN_BWD, ids=varlen_tile_id)
@pytest.mark.parametrize("causal", [True, False])
def test_backward_fp32_every_varlen_tile(entry, causal, gen):
    """dq, dk, dv poisoned before one launch of the three VARLEN kernels, from fp64 math's output and LSE: every
    row is written (keys of a sequence with no query row get 0) and matches fp64 math's gradients."""
    backend, tile = entry
    mask = _causal_mask(causal)
    q, k, v, cu_q, cu_k = packed(gen, 4, 2, 32, torch.float32)
    dout = torch.randn(q.shape, generator=gen)
    out, lse = torch.zeros_like(q), torch.full((4, q.shape[0]), float("-inf"))
    refs = {}
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop > rows.start and keys.stop > keys.start:
            args = (bhsd(q[rows]), bhsd(k[keys]), bhsd(v[keys]))
            ref, ref_lse, grads = oracle(*args, mask=mask, scale=0.3, dout=bhsd(dout[rows]))
            out[rows] = ref[0].transpose(0, 1).float()
            lse[:, rows] = ref_lse[0].float()
            refs[b] = (args, grads, peer_error(*args, mask=mask, scale=0.3, dout=bhsd(dout[rows]))[1])
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)]
    grads = [t.unsqueeze(0).transpose(1, 2) for t in (dout, dq, dk, dv)]
    module(backend, "bwd", tile).launch(*views, lse.unsqueeze(0), *grads, causal=causal, scale=0.3,
                                        varlen=(cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K)))
    for t, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert not t.isnan().any(), f"{name}: unwritten (NaN) rows"
    ulps = 8 * math.sqrt(max(LENGTHS_K))
    for b, rows, keys in sequences(cu_q, cu_k):
        if b not in refs:  # no query row or no key: its keys' gradients are 0
            assert (dk[keys] == 0).all() and (dv[keys] == 0).all() and (dq[rows] == 0).all()
            continue
        args, ref_grads, peer_grads = refs[b]
        assert_grads_close([bhsd(dq[rows]), bhsd(dk[keys]), bhsd(dv[keys])], ref_grads, peer_grads, *args,
                           bhsd(dout[rows]), mask, 0.3, ulps)


# (heads_q, heads_kv, head_dim, causal, window, softcap, sinks, alibi)
CASES = [(4, 2, 32, True, (-1, -1), 0.0, False, False), (2, 2, 64, False, (-1, -1), 0.0, False, False),
         (4, 1, 32, False, (9, 4), 2.0, True, False), (2, 1, 32, True, (-1, -1), 0.0, False, True)]


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_varlen_fp16_forward_and_backward(backend, case, gen):
    """The public call: one Decision for the packed batch (the VARLEN variants, forward and backward), the LSE
    (heads, total_q), and gradients of q, k, v (and the sinks) against fp64 math per sequence."""
    hq, hkv, d, causal, window, cap, with_sinks, with_alibi = case
    mask = _causal_mask(causal, window)
    q, k, v, cu_q, cu_k = packed(gen, hq, hkv, d, torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = (torch.randn(hq, generator=gen) * 2.0).requires_grad_() if with_sinks else None
    slopes = torch.rand(len(LENGTHS_Q), hq, generator=gen) if with_alibi else None
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                window_size=window, softcap=cap, sinks=sinks, alibi_slopes=slopes, return_lse=True,
                                backend=backend)
    decision = last_decision()
    assert decision.problem.varlen and decision.problem.batch == len(LENGTHS_Q)
    assert decision.problem.seqlen_q == max(LENGTHS_Q) and decision.problem.seqlen_k == max(LENGTHS_K)
    assert (decision.forward.backend, decision.backward.backend) == (backend, backend)
    assert decision.forward.variant.varlen and decision.backward.variant.varlen
    assert out.shape == (q.shape[0], hq, d) and lse.shape == (hq, q.shape[0])
    features = dict(softcap=cap, sinks=sinks, alibi_slopes=slopes)
    ulps = 4 * math.sqrt(max(LENGTHS_K))
    check_forward(out.detach(), lse.detach(), q, k, v, cu_q, cu_k, mask, d ** -0.5, ulps, **features)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    wrt = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad(out, wrt, dout)
    for t, name in zip(grads, ("dq", "dk", "dv")):
        assert not t.isnan().any(), name
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            assert (grads[1][keys] == 0).all() and (grads[0][rows] == 0).all()
            continue
        one = dict(features, alibi_slopes=None if slopes is None else slopes[b:b + 1], dout=bhsd(dout[rows]))
        args = (bhsd(q[rows]), bhsd(k[keys]), bhsd(v[keys]))
        _, _, ref_grads = oracle(*args, mask=mask, **one)
        _, peer_grads = peer_error(*args, mask=mask, **one)
        assert_grads_close([bhsd(grads[0][rows]), bhsd(grads[1][keys]), bhsd(grads[2][keys])], ref_grads[:3],
                           peer_grads[:3], *args, bhsd(dout[rows]), mask, d ** -0.5, ulps)
    if sinks is not None:  # the dense call's formula on this call's own packed output and LSE, in fp64
        share = torch.exp(sinks.detach().double()[:, None] - lse.detach().double())  # (heads, total_q)
        want = -(share * (dout.double() * out.detach().double()).sum(-1).T).sum(1)
        assert_close("dsinks", grads[3], want, want.float(), ulps=ulps * math.sqrt(2 * sum(LENGTHS_Q)))


def test_one_sequence_is_the_dense_kernel(gen):
    """A packed batch of one sequence gives the dense call's answer bit for bit (same tile, same loop order)."""
    from attnforge import attention

    q, k, v, cu_q, cu_k = packed(gen, 2, 1, 32, torch.float16, [77], [131])
    out = attention_varlen(q, k, v, cu_q, cu_k, 77, 131, causal=True, backend="triton_fa2")
    dense = attention(q[None], k[None], v[None], causal=True, layout="bshd", backend="triton_fa2")[0]
    assert torch.equal(out, dense)

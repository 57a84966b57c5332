"""attnforge as torch's flash-attention implementation: registered on import (never activated), and the
functions it installs for the aten flash ops give torch's semantics, checked here on the CPU by calling them
directly against fp64 math: the aten LSE shape, top-left is_causal for SDPA's op and bottom-right for
FlashAttention's, the meta functions' strides, zero philox seeds, and clear refusals."""

import math

import pytest
import torch

import attnforge
from attnforge.dispatch.mask import Mask
from attnforge.integrations import torch_flash
from attnforge.testing import assert_close, oracle, peer_error

registry = pytest.importorskip("torch.nn.attention", reason="torch has no flash-attention registry")
if not hasattr(registry, "list_flash_attention_impls"):
    pytest.skip("this torch (< 2.9) has no flash-attention registry", allow_module_level=True)


def test_registered_on_import_and_not_activated():
    assert "attnforge" in registry.list_flash_attention_impls()
    assert registry.current_flash_attention_impl() != "attnforge"


def test_activate_and_restore():
    registry.activate_flash_attention_impl("attnforge")
    try:
        assert registry.current_flash_attention_impl() == "attnforge"
    finally:
        registry.restore_flash_attention_impl()
    assert registry.current_flash_attention_impl() is None


def tensors(gen, seqlen_q, seqlen_k, layout, heads=4, heads_kv=2, dim=16):
    """fp32 q, k, v (GQA 4/2) in ``layout`` order ("bhsd": (batch, heads, seqlen, dim), SDPA's op, here views
    of (batch, seqlen, heads, dim) storage as Hugging Face passes them; "bshd": FlashAttention's op)."""
    def make(h, n):
        t = torch.randn(2, n, h, dim, generator=gen)
        return t.transpose(1, 2) if layout == "bhsd" else t
    return make(heads, seqlen_q), make(heads_kv, seqlen_k), make(heads_kv, seqlen_k)


def check(layout, top_left, q, k, v, causal, out, lse, dout, grads):
    """out, lse and (dq, dk, dv) in ``layout`` against fp64 math with the mask the op means."""
    def bhsd(t):
        return t if layout == "bhsd" else t.transpose(1, 2)

    q_, k_, v_, o_, d_ = (bhsd(t) for t in (q, k, v, out, dout))
    mask = Mask(causal=causal, top_left=causal and top_left)
    ref, ref_lse, ref_grads = oracle(q_, k_, v_, mask=mask, scale=0.3, dout=d_)
    peer, peer_grads = peer_error(q_, k_, v_, mask=mask, scale=0.3, dout=d_)
    # as tests/test_api.py: rounding accumulates like a random walk over the reductions (sequence and head
    # dim), sqrt(length) units on top of 2x PyTorch's own error
    ulps = 4 * math.sqrt(max(*q_.shape[2:], k_.shape[2]))
    assert_close("out", o_, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert_close(name, bhsd(g), r, p, ulps=ulps)


def assert_meta_strides(results, like):
    """The strides torch's meta functions give: empty_like of the inputs."""
    for r, t in zip(results, like):
        assert r.shape == t.shape and r.stride() == torch.empty_like(t).stride()


LENGTHS = [(17, 17), (5, 17), (17, 5), (1, 113)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_op_is_top_left_with_torchs_outputs(seqlen_q, seqlen_k, causal, gen):
    q, k, v = tensors(gen, seqlen_q, seqlen_k, "bhsd")
    out, lse, cq, ck, max_q, max_k, seed, offset, debug = torch_flash.sdpa_flash_forward(q, k, v, is_causal=causal,
                                                                                          scale=0.3)
    assert (cq, ck, max_q, max_k) == (None, None, seqlen_q, seqlen_k)
    assert lse.shape == (2, 4, seqlen_q) and lse.dtype == torch.float32
    assert seed.dtype == offset.dtype == torch.uint64 and seed.shape == (2,) and offset.shape == ()
    assert not seed.any() and not offset.any() and debug.numel() == 0
    dout = torch.randn(out.shape, generator=gen)
    grads = torch_flash.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, max_q, max_k, 0.0, causal, seed,
                                            offset, scale=0.3)
    assert_meta_strides((out, *grads), (q, q, k, v))
    check("bhsd", True, q, k, v, causal, out, lse, dout, grads)
    assert attnforge.last_decision().problem.needs_grad  # the call's Decision is reported


@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_op_is_bottom_right_in_bshd(seqlen_q, seqlen_k, causal, gen):
    q, k, v = tensors(gen, seqlen_q, seqlen_k, "bshd")
    out, lse, seed, offset, debug = torch_flash.flash_forward(q, k, v, None, None, seqlen_q, seqlen_k, 0.0, causal,
                                                              False, scale=0.3)
    assert lse.shape == (2, 4, seqlen_q) and lse.dtype == torch.float32 and not seed.any()
    dout = torch.randn(out.shape, generator=gen)
    grads = torch_flash.flash_backward(dout, q, k, v, out, lse, None, None, seqlen_q, seqlen_k, 0.0, causal, seed,
                                       offset, scale=0.3)
    assert_meta_strides((out, *grads), (q, q, k, v))
    check("bshd", False, q, k, v, causal, out, lse, dout, grads)
    inplace = torch.full_like(out, float("nan"))
    lse2 = torch_flash.flash_forward_no_dropout_inplace(inplace, q, k, v, None, None, seqlen_q, seqlen_k, 0.0, causal,
                                                       False, scale=0.3)
    assert torch.equal(inplace, out) and torch.equal(lse2, lse)


def test_default_scale_is_one_over_sqrt_dim(gen):
    q, k, v = tensors(gen, 17, 17, "bhsd")
    out = torch_flash.sdpa_flash_forward(q, k, v)[0]
    assert torch.equal(out, torch_flash.sdpa_flash_forward(q, k, v, scale=16 ** -0.5)[0])


@pytest.mark.parametrize("what,kwargs", [
    ("dropout_p", dict(dropout_p=0.1)),
    ("return_debug_mask", dict(return_debug_mask=True)),
])
def test_sdpa_op_refuses_what_it_does_not_serve(what, kwargs, gen):
    q, k, v = tensors(gen, 17, 17, "bhsd")
    with pytest.raises(attnforge.BackendUnavailableError, match=f"does not serve .*{what}"):
        torch_flash.sdpa_flash_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("what", ["cum_seq_k", "seqused_k", "alibi_slopes", "block_table", "sliding_window"])
def test_flash_op_refuses_what_it_does_not_serve(what, gen):
    q, k, v = tensors(gen, 17, 17, "bshd")
    args = dict(cum_seq_q=None, cum_seq_k=None)
    kwargs = {}
    if what == "cum_seq_k":  # offsets for q and none for k: not a packed batch
        args = dict(cum_seq_q=torch.tensor([0, 17], dtype=torch.int32), cum_seq_k=None)
    elif what == "sliding_window":
        kwargs = dict(window_size_left=4, window_size_right=0)
    else:
        kwargs = {what: torch.zeros(2, dtype=torch.int32)}
    with pytest.raises(attnforge.BackendUnavailableError, match=f"does not serve .*{what}"):
        torch_flash.flash_forward(q, k, v, args["cum_seq_q"], args["cum_seq_k"], 17, 17, 0.0, False, False, **kwargs)


def test_unbounded_window_is_no_window(gen):
    q, k, v = tensors(gen, 17, 17, "bshd")
    plain = torch_flash.flash_forward(q, k, v, None, None, 17, 17, 0.0, True, False)[0]
    unbounded = torch_flash.flash_forward(q, k, v, None, None, 17, 17, 0.0, True, False, window_size_left=-1,
                                          window_size_right=-1)[0]
    assert torch.equal(plain, unbounded)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_op_serves_packed_batches_as_attention_varlen(causal, gen):
    """cum_seq_q/cum_seq_k (torch's jagged nested tensors): (total, heads, dim) tensors, LSE (heads, total_q) as torch's
    meta function gives it, out and gradients with the inputs' strides, each sequence against fp64 math alone
    (bottom-right causal per sequence, zero-length sequences included)."""
    lengths_q, lengths_k = [5, 0, 17, 1], [9, 4, 17, 30]
    q = torch.randn(sum(lengths_q), 4, 16, generator=gen)
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=gen) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    out, lse, seed, offset, debug = torch_flash.flash_forward(q, k, v, cu_q, cu_k, 17, 30, 0.0, causal, False,
                                                              scale=0.3)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32 and not seed.any() and debug.numel() == 0
    assert attnforge.last_decision().problem.varlen
    dout = torch.randn(out.shape, generator=gen)
    grads = torch_flash.flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, 17, 30, 0.0, causal, seed, offset,
                                       scale=0.3)
    assert_meta_strides((out, *grads), (q, q, k, v))
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if rows.stop == rows.start:
            continue
        one = [t[None] for t in (q[rows], k[keys], v[keys], out[rows], dout[rows])]
        check("bshd", False, *one[:3], causal, one[3], lse[:, rows][None], one[4],
              (grads[0][rows][None], grads[1][keys][None], grads[2][keys][None]))

"""attnforge.sdpa: torch's SDPA signature and meaning, dispatched by attnforge."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import attnforge
from attnforge import InvalidInputError
from attnforge.dispatch import PROFILES, decide, registered
from attnforge.dispatch.mask import Mask


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


CASES = [  # (heads_q, heads_kv, seqlen_q, seqlen_k, is_causal, mask kind)
    (4, 4, 33, 33, False, None), (4, 4, 33, 33, True, None), (4, 2, 17, 65, True, None),
    (4, 1, 65, 17, True, None), (4, 4, 33, 47, False, "bool"), (4, 2, 33, 47, False, "additive"),
    (2, 2, 1, 9, False, "bool"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_sdpa_forward_and_backward(case, dtype, gen):
    hq, hkv, nq, nk, causal, kind = case
    q, k, v = rand(gen, 2, hq, nq, 32, dtype=dtype), rand(gen, 2, hkv, nk, 32, dtype=dtype), rand(gen, 2, hkv, nk, 32, dtype=dtype)
    mask = None
    if kind == "bool":
        mask = torch.rand(nq, nk, generator=gen) > 0.3
    elif kind == "additive":
        mask = rand(gen, 1, 1, nq, nk, dtype=dtype)
    gqa = hq != hkv
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnforge.sdpa(*ours, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(*theirs, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref, **tol)  # same kernel or a reference-checked one: same meaning
    dout = rand(gen, *out.shape, dtype=dtype)
    for g, r in zip(torch.autograd.grad(out, ours, dout), torch.autograd.grad(ref, theirs, dout)):
        torch.testing.assert_close(g, r, **tol)
    decision = attnforge.last_decision()
    if kind is not None:
        assert decision.forward.backend == "sdpa" and decision.problem.mask == Mask(tensor=True)
        assert decision.forward.reasons_of("reference") == ("an attn_mask tensor is not supported",)
    elif causal and nq != nk:  # SDPA's top-left alignment: not what attention() computes
        assert decision.problem.mask == Mask(causal=True, top_left=True) and decision.forward.backend == "sdpa"
        # the reference backend runs the mask model's top-left rule too (so it is eligible) and agrees
        assert decision.forward.reasons_of("reference") == ()
        with attnforge.use_backend("reference"):
            by_reference = attnforge.sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        assert attnforge.last_decision().forward.backend == "reference"
        torch.testing.assert_close(by_reference, ref.detach(), **tol)
        # the fast kernels align bottom-right only: they refuse it, saying so
        on_h100 = decide(dataclasses.replace(decision.problem, device=PROFILES["H100"]))
        for name in ("cute_sm90", "triton_fa2"):
            if name in registered():
                assert any("top-left causal alignment" in r for r in on_h100.forward.reasons_of(name))
        bottom_right = attnforge.attention(q, k, v, causal=True)
        assert not torch.allclose(out.detach(), bottom_right, atol=1e-3)


def test_errors_mirror_torch():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(InvalidInputError, match="pass enable_gqa=True"):
        attnforge.sdpa(q, k, k)
    with pytest.raises(InvalidInputError, match="not both"):
        attnforge.sdpa(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)


def test_a_forced_backend_that_cannot_take_the_mask_says_so():
    q = torch.randn(1, 2, 8, 16)
    with attnforge.use_backend("reference"):
        with pytest.raises(attnforge.BackendUnavailableError, match="an attn_mask tensor is not supported"):
            attnforge.sdpa(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))


SHAPES = [  # (query, key, value) shapes in torch's (..., seqlen, head_dim), enable_gqa
    (((3, 13, 8), (3, 21, 8), (3, 21, 6)), False),  # 3-D: (N, L, E)
    (((4, 13, 8), (2, 21, 8), (2, 21, 6)), True),  # 3-D with enable_gqa: torch groups the leading dim
    (((13, 8), (21, 8), (21, 6)), False),  # 2-D: (L, E)
    (((2, 3, 4, 13, 8), (2, 3, 2, 21, 8), (2, 3, 2, 21, 6)), True),  # 5-D
    (((2, 1, 3, 2, 13, 8), (2, 1, 3, 2, 21, 8), (2, 1, 3, 2, 21, 6)), False),  # 6-D
]
MASKS = {"none": None, "bool-2d": (13, 21), "bool-full": "full", "bool-lead": "lead"}


def sdpa_mask(kind, q_shape, gen):
    if kind == "none":
        return None
    shape = {"bool-2d": (13, 21), "bool-full": (*q_shape[:-2], 13, 21),
             "bool-lead": (q_shape[0], *(1,) * (len(q_shape) - 3), 13, 21) if len(q_shape) > 2 else (13, 21)}[kind]
    return torch.rand(*shape, generator=gen) > 0.3


@pytest.mark.parametrize("shapes, gqa", SHAPES, ids=lambda s: "x".join(map(str, s[0])) if isinstance(s, tuple) else str(s))
@pytest.mark.parametrize("causal, kind", [(False, "none"), (True, "none"), (False, "bool-2d"), (False, "bool-full"),
                                          (False, "bool-lead")])
def test_any_number_of_leading_dims_as_torch(shapes, gqa, causal, kind, gen):
    """torch's SDPA takes (..., seqlen, head_dim): attnforge.sdpa gives its result and gradients, in its shape."""
    q, k, v = (rand(gen, *s, dtype=torch.float64) for s in shapes)
    mask = sdpa_mask(kind, q.shape, gen)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnforge.sdpa(*ours, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*theirs, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    dout = rand(gen, *out.shape, dtype=torch.float64)
    for name, g, r in zip("qkv", torch.autograd.grad(out, ours, dout), torch.autograd.grad(ref, theirs, dout)):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("shapes, words", [
    (((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 4, 7, 8)), "same number of dimensions"),
    (((8,), (8,), (8,)), "at least 2"),
    (((2, 3, 4, 5, 8), (1, 3, 4, 7, 8), (1, 3, 4, 7, 8)), "same batch dims"),
])
def test_inputs_of_other_ranks_that_do_not_fit_are_named(shapes, words, gen):
    q, k, v = (rand(gen, *s) for s in shapes)
    with pytest.raises(InvalidInputError, match=words):
        attnforge.sdpa(q, k, v)


def test_a_mask_that_does_not_fit_leading_dims_is_named(gen):
    q = rand(gen, 2, 3, 4, 5, 8)
    with pytest.raises(InvalidInputError, match="does not broadcast to query's batch dims"):
        attnforge.sdpa(q, q, q, attn_mask=torch.ones(4, 1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(InvalidInputError, match="more dims than query"):
        attnforge.sdpa(q[0, 0], q[0, 0], q[0, 0], attn_mask=torch.ones(2, 4, 5, 5, dtype=torch.bool))


@pytest.mark.parametrize("kind", ["plain", "causal", "top-left", "mask", "gqa-3d"])
def test_meta_tensors_go_to_torch_sdpa_with_the_reason(kind):
    """A device attnforge has no kernels for (meta here; mps and xpu alike) is torch's SDPA's, and the
    Decision says why instead of refusing the call. Shapes only: meta tensors hold no data."""
    q, k, v = (torch.empty(2, 4, 13, 8, device="meta"), torch.empty(2, 4, 21, 8, device="meta"),
               torch.empty(2, 4, 21, 6, device="meta"))
    kwargs = {"plain": {}, "causal": {"is_causal": True}, "top-left": {"is_causal": True},
              "mask": {"attn_mask": torch.empty(13, 21, dtype=torch.bool, device="meta")}, "gqa-3d": {}}[kind]
    if kind == "causal":
        k, v = k[:, :, :13], v[:, :, :13]
    if kind == "gqa-3d":
        q, k, v, kwargs = q[0], k[0, :2], v[0, :2], {"enable_gqa": True}
    q.requires_grad_()
    out = attnforge.sdpa(q, k, v, **kwargs)
    assert out.device.type == "meta"
    assert out.shape == F.scaled_dot_product_attention(q, k, v, **kwargs).shape
    decision = attnforge.last_decision()
    assert decision.forward.backend == "sdpa" and decision.problem.device.arch == "meta"
    assert "attnforge has no kernels for meta devices" in str(decision)
    out.sum().backward()
    assert q.grad.shape == q.shape and q.grad.device.type == "meta"


def test_torch_kernel_restriction_holds_where_torch_runs(gen):
    """Inside sdpa_kernel(...), a call that goes to torch's SDPA (a mask tensor here) runs under the caller's
    restriction: the math kernel's bits where only math is allowed, torch's own refusal where the allowed
    kernel cannot take the call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = rand(gen, 2, 4, 13, 16), rand(gen, 2, 4, 21, 16), rand(gen, 2, 4, 21, 16)
    mask = torch.rand(13, 21, generator=gen) > 0.3
    attnforge.sdpa(q, k, v, attn_mask=mask)  # first use (and its self-check) outside the restriction
    with sdpa_kernel(SDPBackend.MATH):
        out = attnforge.sdpa(q, k, v, attn_mask=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert attnforge.last_decision().forward.backend == "sdpa"
    assert torch.equal(out, ref.masked_fill(~mask.any(-1)[..., None], 0.0))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # no CPU kernel: torch refuses, and so does the call
        with pytest.raises(RuntimeError) as theirs:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with pytest.raises(RuntimeError) as ours:
            attnforge.sdpa(q, k, v, attn_mask=mask)
    assert str(ours.value) == str(theirs.value)

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

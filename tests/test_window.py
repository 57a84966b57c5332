"""Sliding windows (``window_size=(left, right)``, FlashAttention's semantics) on every backend that declares
them, forward and backward, against fp64 math; backends that do not say so in the Decision."""

import math

import pytest
import torch

import attnforge
from attnforge import InvalidInputError
from attnforge.api import _causal_mask
from attnforge.dispatch import registered
from attnforge.testing import assert_close, assert_grads_close, oracle, peer_error, sees

WINDOWS = [(False, (3, 2)), (True, (4, -1)), (False, (-1, 0)), (True, (0, 0)), (False, (5, -1)), (True, (30, 7))]
LENGTHS = [(17, 17), (1, 113), (17, 40), (40, 17), (113, 113)]
# The backends that serve these fp32 CPU calls; the Triton kernels' windows run in the interpreter
# (tests/backends/triton_fa2/interpreter/test_window.py).
SERVING = [name for name, b in registered().items()
           if b.support.window and "cpu" in b.support.vendors and "fp32" in b.support.dtypes]


@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_the_rule_is_flash_attentions(causal, window, seqlen_q, seqlen_k):
    """Query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1 unbounded), right = 0 when
    causal: written out here, independently of dispatch/mask.py."""
    left, right = window
    if causal:
        right = 0
    want = torch.tensor([[(left < 0 or j >= i + seqlen_k - seqlen_q - left) and (right < 0 or j <= i + seqlen_k - seqlen_q + right)
                          for j in range(seqlen_k)] for i in range(seqlen_q)])
    assert torch.equal(sees(_causal_mask(causal, window), seqlen_q, seqlen_k), want)


def inputs(gen, seqlen_q, seqlen_k, dtype=torch.float32, requires_grad=True):
    shapes = ((2, 4, seqlen_q, 16), (2, 2, seqlen_k, 16), (2, 2, seqlen_k, 16))  # GQA 4/2
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


@pytest.mark.parametrize("backend", SERVING)
@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_forward_and_backward_match_fp64(backend, causal, window, seqlen_q, seqlen_k, gen):
    q, k, v = inputs(gen, seqlen_q, seqlen_k)
    mask = _causal_mask(causal, window)
    out = attnforge.attention(q, k, v, causal=causal, window_size=window, backend=backend, scale=0.3)
    assert attnforge.last_decision().problem.mask == mask
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse, ref_grads = oracle(q, k, v, mask=mask, scale=0.3, dout=dout)
    peer, peer_grads = peer_error(q, k, v, mask=mask, scale=0.3, dout=dout)
    ulps = 4 * math.sqrt(max(seqlen_q, seqlen_k, 16))  # as tests/test_api.py
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_grads_close(grads, ref_grads, peer_grads, q, k, v, dout, mask, 0.3, ulps)
    visible = sees(mask, seqlen_q, seqlen_k)
    blind = ~visible.any(-1)  # rows the window hides every key from: 0, no gradient
    assert (out[:, :, blind] == 0).all() and (grads[0][:, :, blind] == 0).all()


def test_reference_gradcheck_in_fp64(gen):
    q, k, v = (t.double().detach().requires_grad_() for t in inputs(gen, 7, 11))
    torch.autograd.gradcheck(lambda q, k, v: attnforge.attention(q, k, v, window_size=(2, 1), backend="reference",
                                                                 return_lse=True), (q, k, v))


def test_the_lse_of_a_row_the_window_hides_everything_from_is_minus_inf(gen):
    q, k, v = inputs(gen, 40, 17, requires_grad=False)
    out, lse = attnforge.attention(q, k, v, causal=True, window_size=(2, -1), backend="reference", return_lse=True)
    assert (lse[:, :, :23] == float("-inf")).all() and torch.isfinite(lse[:, :, 23:]).all()


@pytest.mark.parametrize("backend", SERVING)
def test_a_nan_key_reaches_only_the_rows_that_see_it(backend, gen):
    q, k, v = inputs(gen, 17, 17, requires_grad=False)
    k[:, :, 8] = float("nan")
    out = attnforge.attention(q, k, v, window_size=(2, 1), backend=backend)
    sees_it = sees(_causal_mask(False, (2, 1)), 17, 17)[:, 8]
    assert out[:, :, sees_it].isnan().all() and not out[:, :, ~sees_it].isnan().any()


@pytest.mark.parametrize("tensor, value", [("k", float("inf")), ("k", float("-inf")), ("v", float("nan")),
                                           ("v", float("inf"))])
def test_sdpa_keeps_a_non_finite_key_or_value_to_the_rows_that_see_it(tensor, value, gen):
    """sdpa's materialised window mask is additive: a hidden infinite key (inf + -inf) or non-finite value
    (0 * nan) reached every row before; now only the rows that see it are non-finite, the others exact."""
    q, k, v = inputs(gen, 17, 17, requires_grad=False)
    {"k": k, "v": v}[tensor][:, :, 8, 3] = value
    out = attnforge.attention(q, k, v, window_size=(2, 1), backend="sdpa")
    sees_it = sees(_causal_mask(False, (2, 1)), 17, 17)[:, 8]
    assert out[:, :, sees_it].isnan().all()  # (NaN also for an infinite value: see sdpa's _windowed)
    clean = {"k": k, "v": v}[tensor].clone()
    clean[:, :, 8] = 0.0
    ref = attnforge.attention(q, *((clean, v) if tensor == "k" else (k, clean)), window_size=(2, 1), backend="reference")
    assert out[:, :, ~sees_it].isfinite().all()
    torch.testing.assert_close(out[:, :, ~sees_it], ref[:, :, ~sees_it])


def test_causal_takes_right_as_zero():
    assert _causal_mask(True, (3, 5)) == _causal_mask(True, (3, 0)) == _causal_mask(True, [3, -1])
    assert _causal_mask(False, [-1, -1]) == attnforge.dispatch.mask.NONE


@pytest.mark.parametrize("bad", [(-2, 0), (1,), "x", (1.5, 0), (True, 0), None, (1, 2, 3)])
def test_a_bad_window_size_is_named(bad, gen):
    q, k, v = inputs(gen, 5, 5, requires_grad=False)
    with pytest.raises(InvalidInputError, match="window_size must be"):
        attnforge.attention(q, k, v, window_size=bad)


# (device, forward backend, backward backend): cute_sm90 has WINDOW forward and backward kernels, cute_sm100 forward
# kernels and no backward
WINDOW_SERVED = [("H100", "cute_sm90", "cute_sm90"), ("B200", "cute_sm100", "triton_fa2"),
                 ("A100", "triton_fa2", "triton_fa2"), ("MI300X", "triton_rocm", "triton_rocm")]


@pytest.mark.parametrize("device,fwd,bwd", WINDOW_SERVED)
def test_the_kernels_with_a_window_serve_it_and_the_others_say_why_not(device, fwd, bwd):
    d = attnforge.explain(device=device, dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, window_size=(1024, 0),
                          needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == (fwd, bwd)
    assert d.forward.variant.window if fwd.startswith("cute") else d.forward.variant.local
    assert "+window" in d.forward.describe() and "+window" in d.backward.describe()
    assert not d.fallback
    if bwd == "cute_sm90":
        assert d.forward.variant.name.endswith("_window.bf16.causal")
        assert d.backward.variant.window and d.backward.variant.name.endswith("_window.bf16.causal")
    else:
        assert d.backward.variant.local and d.backward.variant.name.endswith(".causal.local")


def test_forcing_cute_sm90_runs_its_window_backward_but_not_the_deterministic_one():
    d = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, window_size=(1024, 0),
                          needs_grad=True, backend="cute_sm90")
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90")
    assert d.backward.variant.window and d.backward.variant.name.endswith("_window.bf16.causal")
    assert "+window" in d.backward.describe()
    det = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True,
                            window_size=(1024, 0), needs_grad=True, deterministic=True)
    assert "its deterministic backward has no sliding window" in " ".join(det.backward.reasons_of("cute_sm90"))
    capped = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, softcap=30.0,
                               window_size=(1024, 0), needs_grad=True, backend="cute_sm90")
    assert capped.backward.backend == "cute_sm90" and capped.backward.variant.name.endswith("_window_softcap.bf16.full")


def test_sdpa_says_it_materialises_the_window_mask():
    d = attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, window_size=(1024, 0),
                          backend="sdpa")
    assert d.forward.backend == "sdpa" and "materialised 4096 x 4096 mask" in d.forward.describe()


def test_compiled_window_matches_eager(gen):
    q, k, v = inputs(gen, 17, 23)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True, window_size=(4, 0)), fullgraph=True,
                       backend="aot_eager")
    out = fn(q, k, v)
    assert attnforge.last_decision().problem.mask == _causal_mask(True, (4, 0))
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager = attnforge.attention(q, k, v, causal=True, window_size=(4, 0))
    for g, e in zip(grads, torch.autograd.grad(eager, (q, k, v), dout)):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_a_compiled_window_call_traces_without_dynamo_warnings(gen):
    """Dynamo warns when it traces through an lru_cache-wrapped function; the window's Mask is built without one
    while tracing (a model compiled with sliding windows shows no warning)."""
    import warnings

    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen) for _ in range(3))
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True, window_size=(7, 0)), fullgraph=True,
                       backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(q, k, v)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    torch.testing.assert_close(out, attnforge.attention(q, k, v, causal=True, window_size=(7, 0)), atol=0, rtol=0)

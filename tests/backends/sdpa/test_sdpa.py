"""The sdpa backend where torch's SDPA alone gives a wrong answer: non-finite inputs, a zero scale, rows a
mask tensor hides entirely; and its double backward (torch autograd, so correct). CPU here; the same
checks on the GPU are in tests/backends/cute_sm90/test_gpu.py."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.gradcheck import GradcheckError
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnforge
from attnforge import attention
from attnforge.dispatch.mask import CAUSAL, NONE
from attnforge.testing import assert_close, assert_nan_rows, oracle, peer_error, poison, sees

# (heads_q, heads_kv, seqlen_q, seqlen_k, causal): the lower-right causal bias (seqlen_q < seqlen_k), the
# square and the blind-rows (seqlen_q > seqlen_k) paths, and no mask.
SHAPES = [(4, 2, 19, 150, True), (2, 2, 1, 33, True), (2, 1, 37, 37, True), (4, 2, 150, 19, True), (2, 2, 23, 40, False)]


def qkv(gen, hq, hkv, nq, nk, d=24, dtype=torch.float32):
    return (torch.randn(2, hq, nq, d, generator=gen).to(dtype), torch.randn(2, hkv, nk, d, generator=gen).to(dtype),
            torch.randn(2, hkv, nk, d, generator=gen).to(dtype))


@pytest.mark.parametrize("tensor", ["q", "k"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_nan_reaches_exactly_the_rows_that_see_it(shape, tensor, gen):
    """A NaN query row gives a NaN row; a NaN key NaN in the rows that see it only. With causal and
    seqlen_q < seqlen_k, torch's lower-right bias added -inf to a hidden NaN score and spread one NaN key
    to every row. (A NaN value reaches the rows of its tile in every fused kernel, torch's included:
    0 * NaN in P @ V; the reference backend is exact there, see tests/backends/reference.)"""
    hq, hkv, nq, nk, causal = shape
    mask = CAUSAL if causal else NONE
    q, k, v = qkv(gen, hq, hkv, nq, nk)
    visible = sees(mask, nq, nk)
    indices = [nq - 1] if tensor == "q" else sorted({0, int(visible.any(0).nonzero()[-1]), nk - 1})
    for index in indices:
        qn, kn, vn, rows = poison(q, k, v, tensor, index, mask)
        out = attention(qn, kn, vn, causal=causal, scale=0.3, backend="sdpa")
        ref, _, _ = oracle(qn, kn, vn, causal=causal, scale=0.3)
        peer, _ = peer_error(q, k, v, causal=causal, scale=0.3)
        assert_nan_rows("out", out, ref, peer, rows, ulps=16)


# (heads_q, heads_kv, seqlen_q, seqlen_k): causal with seqlen_q < seqlen_k, where sdpa materialises the lower-right
# mask (the CPU, and small problems on the GPU)
LOWER_RIGHT = [(4, 2, 19, 150), (2, 2, 9, 10), (2, 1, 37, 40)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("shape", LOWER_RIGHT, ids=lambda s: "x".join(map(str, s)))
def test_a_nonfinite_hidden_key_or_value_reaches_only_the_rows_that_see_it(shape, tensor, value, gen):
    """A NaN or infinite key or value among the keys some rows cannot see reached those rows too through the
    materialised lower-right mask (inf + -inf, 0 * NaN); now every row is what exact math gives (the reference
    backend in fp64, which keeps non-finite values to the rows that see them), also with two bad keys."""
    hq, hkv, nq, nk = shape
    q, k, v = qkv(gen, hq, hkv, nq, nk)
    first_hidden = nk - nq + 1  # keys from here on are hidden from some rows
    for indices in ([first_hidden], [nk - 1], [first_hidden + (nq - 1) // 2, nk - 1]):
        kn, vn = k.clone(), v.clone()
        for index in indices:
            (kn if tensor == "k" else vn)[0, 0, index, 3] = value
        out = attention(q, kn, vn, causal=True, scale=0.3, backend="sdpa")
        ref = attention(q.double(), kn.double(), vn.double(), causal=True, scale=0.3, backend="reference")
        assert torch.equal(out.isnan(), ref.isnan()), f"NaN rows differ for keys {indices}"
        assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[out.isinf()], ref[ref.isinf()].float())
        if tensor == "v" or value != value:  # (an infinite key's score is -inf in the rows whose q has the
            assert (ref.isnan() | ref.isinf()).any()  # opposite sign: those stay finite, as exact math)
        finite = ref.isfinite()
        assert torch.allclose(out[finite].double(), ref[finite], atol=1e-5, rtol=1e-5)


def test_a_nan_key_with_gradients(gen):
    """The NaN-key path is differentiable as before: finite gradients for what no NaN row depends on."""
    q, k, v = qkv(gen, 2, 2, 5, 12)
    k[0, 0, 11] = float("nan")  # only the last query row sees key 11
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=True, backend="sdpa")
    assert out[0, 0, -1].isnan().all() and out[0, 0, :-1].isfinite().all() and out[1].isfinite().all()
    dq, dk, dv = torch.autograd.grad(out[1].sum() + out[0, :, :-1].sum(), (q, k, v))
    ref = oracle(q[1:], k[1:], v[1:], causal=True, dout=torch.ones_like(out[1:]))[2]
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert_close(name, g[1:], r, r.float(), ulps=16)


@pytest.mark.parametrize("scale", [0.0, 1e-60, -0.0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_zero_scale_is_the_mean_of_the_visible_values(shape, scale, gen):
    """scale=0 (or one that is 0 in fp32) with causal gave NaN rows in torch's SDPA: the answer is the mean
    of the values each row sees. A NaN query row still gives NaN (0 * NaN)."""
    hq, hkv, nq, nk, causal = shape
    q, k, v = qkv(gen, hq, hkv, nq, nk)
    q[1, 0, -1] = float("nan")
    out = attention(q, k, v, causal=causal, scale=scale, backend="sdpa")
    visible = sees(CAUSAL if causal else NONE, nq, nk).double()
    mean = (visible / visible.sum(-1, keepdim=True).clamp_min(1)) @ v.double().repeat_interleave(hq // hkv, 1)
    rows = torch.zeros(out.shape[:3], dtype=torch.bool)
    rows[1, 0, -1] = True
    mean[1, 0, -1] = float("nan")
    assert_nan_rows("out", out, mean, mean.float(), rows, ulps=16)


def like_the_gpu(monkeypatch):
    """Make the sdpa backend's SDPA answer a row its mask hides entirely as the H200's kernels do (a nonzero
    row, 0.367 measured) instead of the CPU's 0, so that the CPU tests the backend's own handling."""
    from attnforge.backends.sdpa import backend

    def sdpa(q, k, v, attn_mask=None, **kwargs):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is None:
            return out
        blind = ~attn_mask.any(-1) if attn_mask.dtype == torch.bool else (attn_mask == float("-inf")).all(-1)
        return out.masked_fill(blind[..., None], 0.367)

    monkeypatch.setattr(backend, "F", type("F", (), dict(vars(F), scaled_dot_product_attention=staticmethod(sdpa))))


@pytest.mark.parametrize("kernel", ["torch", "like the gpu"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_row_that_hides_every_key_gives_zero(kind, kernel, gen, monkeypatch):
    """attnforge.sdpa with an attn_mask row that hides every key: 0, as attention() gives a row that sees no
    key (torch's kernels disagree there: 0 on the CPU, nonzero on the GPU; test_gpu.py runs the GPU's)."""
    if kernel != "torch":
        like_the_gpu(monkeypatch)
    q, k, v = qkv(gen, 4, 2, 9, 13)
    keep = torch.rand(2, 1, 9, 13, generator=gen) > 0.4
    keep[..., 0] = True
    keep[0, 0, 3] = False
    keep[1, 0, 8] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnforge.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (out[0, :, 3] == 0).all() and (out[1, :, 8] == 0).all()
    rest = keep.any(-1).expand(2, 4, 9)
    kv = [t.double().repeat_interleave(2, 1) for t in (k, v)]
    scores = (q.double() @ kv[0].transpose(-1, -2) / 24 ** 0.5).masked_fill(~keep, float("-inf"))
    ref = torch.softmax(scores, -1).nan_to_num(0.0) @ kv[1]  # (a row of -inf: NaN softmax, 0 by the convention)
    assert_close("out", out[rest], ref[rest], ref[rest].float(), ulps=16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.isfinite().all() for g in grads) and (grads[0][0, :, 3] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 7), (7, 3)])
def test_double_backward_is_torch_autograd_and_correct(causal, nq, nk, gen):
    """sdpa's backward is torch autograd through SDPA: second-order gradients are exact with torch's math
    kernel (gradgradcheck compares them with finite differences in fp64), and torch's fused kernels refuse
    them, saying so; never a silently wrong answer."""
    q, k, v = (t[:1].double().requires_grad_() for t in qkv(gen, 2, 1, nq, nk, d=3))
    run = lambda *x: attention(*x, causal=causal, backend="sdpa")  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.autograd.gradgradcheck(run, (q, k, v), fast_mode=True)
    try:
        assert torch.autograd.gradgradcheck(run, (q, k, v), fast_mode=True)
    except GradcheckError:
        raise
    except RuntimeError as e:  # torch's flash kernels have no second derivative
        assert "derivative for aten::" in str(e) and "is not implemented" in str(e), e


@pytest.mark.parametrize("nq, nk", [(13, 13), (7, 21), (21, 7)])
def test_serves_devices_attnforge_has_no_kernels_for(nq, nk):
    """meta (as mps and xpu) is a TORCH_ONLY device: sdpa serves it in every causal alignment (the lower-right
    bias included, which must not ask CUDA's kernel checks about it); the reference refuses it."""
    from attnforge.dispatch import device as devices
    from attnforge.dispatch.device import TORCH_ONLY

    spec = devices.detect("meta")
    assert spec.vendor == TORCH_ONLY and spec.arch == "meta" and not spec.present
    assert spec.torch_device == torch.device("meta")
    q, k, v = (torch.empty(2, 4, nq, 8, device="meta"), torch.empty(2, 2, nk, 8, device="meta"),
               torch.empty(2, 2, nk, 8, device="meta"))
    out = attention(q, k, v, causal=True)
    assert out.shape == (2, 4, nq, 8) and out.device.type == "meta"
    decision = attnforge.last_decision()
    assert decision.forward.backend == "sdpa" and not decision.fallback
    assert decision.forward.reasons_of("reference") == ("device meta (meta) is not served; serves amd, cpu, nvidia devices",)

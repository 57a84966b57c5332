"""attention() numerics through every registered backend against fp64 math.

The matrix is built from what the backends declare: where a backend's supports() gives reasons
for a case, the test asserts that forcing it raises with those reasons instead of skipping."""

import math

import pytest
import torch

import attnforge
from attnforge import BackendUnavailableError, InvalidInputError, attention, explain, last_decision
from attnforge.dispatch.problem import SMALL_SOFTCAP
from attnforge.dispatch import registered
from attnforge.testing import assert_close, oracle, peer_error, rel_error

BACKENDS = sorted(registered())
# The same matrix runs on the GPU where there is one (the lent H200 runs it; CI has none).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA or ROCm GPU on this machine")])]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v): odd lengths, GQA and MQA,
# seqlen_q != seqlen_k both ways (with causal, 113 > 17 leaves 96 rows that see no key).
SHAPES = [
    (1, 1, 1, 1, 1, 32, 32),
    (2, 4, 4, 17, 17, 64, 64),
    (1, 4, 2, 113, 113, 64, 64),
    (1, 4, 1, 255, 255, 32, 32),
    (1, 2, 2, 17, 113, 64, 64),
    (1, 2, 2, 113, 17, 64, 64),
    (2, 6, 2, 255, 129, 96, 96),
    (1, 2, 1, 33, 65, 64, 32),
]


def make(shape, dtype, gen, layout="bhsd", magnitude=1.0, device="cpu"):
    b, hq, hkv, nq, nk, d, dv = shape

    def rand(h, n, dim, mag=1.0):
        t = (torch.randn(b, h, n, dim, generator=gen) * mag).to(device=device, dtype=dtype)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else t  # bshd memory

    return rand(hq, nq, d, magnitude), rand(hkv, nk, d), rand(hkv, nk, dv)


def as_layout(t, layout):
    return t.transpose(1, 2) if layout == "bshd" else t


def refusal(backend, q, k, v, **kw):
    """The reasons ``backend`` gives for this call (empty: it serves it)."""
    return registered()[backend].supports(explain(q, k, v, **kw).problem)


def fused_sdpa(q, k, v, *, causal, scale):
    """PyTorch's default fused F.scaled_dot_product_attention (bhsd, GQA by repetition) on these inputs."""
    assert not causal or q.shape[2] == k.shape[2], "torch's is_causal is top-left aligned: square calls only"
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def worse(a, b, ref):
    """Whichever of a and b is further from ref (max abs error over the finite entries)."""
    finite = torch.isfinite(ref)
    err = [(t.double() - ref.double())[finite].abs().max().nan_to_num(float("inf")) for t in (a, b)]
    return a if err[0] >= err[1] else b


def run_case(backend, shape, dtype, causal, gen, layout="bhsd", magnitude=1.0, return_lse=None, device="cpu",
             scale=None):
    """Forward (and LSE) against the fp64 oracle element by element; gradients too, except at large
    magnitude (see below)."""
    q, k, v = make(shape, DTYPES[dtype], gen, layout, magnitude, device)
    reasons = refusal(backend, *(as_layout(t, layout) for t in (q, k, v)), causal=causal, layout=layout,
                      needs_grad=True, return_lse=bool(return_lse))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = [as_layout(t, layout) for t in (q, k, v)]
    if reasons:
        with pytest.raises(BackendUnavailableError, match=reasons[0].split("(")[0]):
            attention(*args, causal=causal, layout=layout, backend=backend, return_lse=bool(return_lse), scale=scale)
        return
    res = attention(*args, causal=causal, layout=layout, backend=backend, return_lse=bool(return_lse), scale=scale)
    out, lse = res if return_lse else (res, None)
    out = as_layout(out, layout)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse, ref_grads = oracle(q, k, v, causal=causal, dout=dout, scale=scale)
    peer, peer_grads = peer_error(q, k, v, causal=causal, dout=dout, scale=scale)
    if magnitude != 1.0:
        # Scores ~1e4 make the output ill-conditioned: where a row's two best scores nearly tie, one ulp
        # of a score (1e-3 at 1.2e4 in fp32) moves P by ~1e-4. PyTorch's fused SDPA rounds the score
        # before scaling, at 1/scale its size, so its error there is several times the materialised
        # math's; both are PyTorch's own error in this dtype, and the worse one sets the bound.
        peer = worse(peer, fused_sdpa(q, k, v, causal=causal, scale=scale), ref)
    # Rounding accumulates over a reduction like a random walk: sqrt(length) units, on top of 2x
    # PyTorch's own error (which is tiny in fp32, where summation order alone differs by more).
    # The reductions run over the sequence (P V, dS K, ...) and over the head dim (Q K^T, dO V^T).
    ulps = 4 * math.sqrt(max(shape[3], shape[4], shape[5]))
    assert_close("out", out, ref, peer, ulps=ulps)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        if magnitude == 1.0:
            assert_close(name, g, r, p, ulps=ulps)
            continue
        # Scores ~1e4 make P one-hot. dq and dk then come from cancellation in dS = P * (dP - D)
        # and are ill-conditioned for any fp32 LSE-based backward (SDPA's too): only finiteness is
        # asserted for them. dv = P^T dO is well-conditioned; recomputing P = exp(S - LSE) from an
        # fp32 LSE costs up to eps32 * |LSE| relative error, the allowance on top of 2x PyTorch's.
        assert torch.isfinite(g).all(), f"{name} not finite"
        if name == "dv":
            lse_rounding = torch.finfo(torch.float32).eps * ref_lse[torch.isfinite(ref_lse)].abs().max().item()
            peer_rel = rel_error(p, r)  # NaN where PyTorch's own fp16 math overflows: no help then
            assert rel_error(g, r) <= 2 * (0.0 if math.isnan(peer_rel) else peer_rel) + lse_rounding, name
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)  # LSE is fp32 whatever the inputs
    if causal and shape[3] > shape[4]:  # rows that see no key: exactly 0 out, no gradient, LSE -inf
        blind = shape[3] - shape[4]
        assert (out[:, :, :blind] == 0).all() and (grads[0][:, :, :blind] == 0).all()
        if lse is not None:
            assert (lse[:, :, :blind] == float("-inf")).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64(backend, shape, dtype, causal, device, gen):
    run_case(backend, shape, dtype, causal, gen, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("device", DEVICES)
def test_negative_scale_matches_fp64(backend, dtype, causal, device, gen):
    """SDPA takes any finite scale; so does attention(). A kernel that bounds exp2 by the row max of
    unscaled scores is wrong for a negative one (cute_sm90 gave NaN before it negated q instead)."""
    run_case(backend, (2, 4, 2, 113, 97, 64, 64), dtype, causal, gen, device=device, scale=-0.4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("device", DEVICES)
def test_bshd_layout_and_lse(backend, causal, device, gen):
    run_case(backend, (2, 4, 2, 113, 65, 64, 64), "fp32", causal, gen, layout="bshd", device=device)
    run_case(backend, (1, 4, 2, 65, 113, 64, 64), "fp16", causal, gen, return_lse=True, device=device)
    run_case(backend, (1, 4, 2, 113, 65, 64, 64), "fp32", causal, gen, return_lse=True, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_large_magnitude_scores_do_not_overflow(backend, dtype, device, gen):
    # q ~ 5e3 * N(0, 1) gives scores with std 5e3, up to ~2e4: exp() must see s - max, never s.
    run_case(backend, (1, 2, 2, 65, 65, 64, 64), dtype, True, gen, magnitude=5e3, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_from_packed_qkv(backend, gen):
    qkv = torch.randn(2, 77, 3, 4, 32, generator=gen)  # (batch, seqlen, 3, heads, d): bshd views with gaps
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    reasons = refusal(backend, q, k, v, causal=True, layout="bshd")
    if reasons:
        with pytest.raises(BackendUnavailableError, match=reasons[0].split("(")[0]):
            attention(q, k, v, causal=True, layout="bshd", backend=backend)
        return
    out = attention(q, k, v, causal=True, layout="bshd", backend=backend)
    ref, _, _ = oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    peer, _ = peer_error(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert_close("out", out.transpose(1, 2), ref, peer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_gradcheck_fp64(backend, causal, gen):
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 1, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    fn = lambda q, k, v: attention(q, k, v, causal=causal, scale=0.7, backend=backend)  # noqa: E731
    reasons = refusal(backend, q, k, v, causal=causal, needs_grad=True)
    if reasons:  # fp64 is for checking: backends of fp16/bf16 kernels refuse it and say so
        assert any("dtype fp64 is not supported" in r for r in reasons)
        with pytest.raises(BackendUnavailableError, match="dtype fp64 is not supported"):
            fn(q, k, v)
        return
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_scale_default_and_explicit(gen):
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    ref, _, _ = oracle(q, k, v, causal=False, scale=0.3)
    assert_close("out", attention(q, k, v, scale=0.3), ref, ref.float())
    ref, _, _ = oracle(q, k, v, causal=False)
    assert_close("out", attention(q, k, v), ref, ref.float())


def test_dropout_runs_on_sdpa_and_keeps_expectation(gen):
    q, k, v = (torch.randn(1, 1, 64, 16, generator=gen) for _ in range(3))
    torch.manual_seed(0)
    dropped = attention(q, k, v, dropout_p=0.5)
    full = attention(q, k, v)
    assert not torch.allclose(dropped, full)
    assert explain(q, k, v, dropout_p=0.5).forward.backend == "sdpa"
    mean = torch.stack([attention(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert (mean - full).abs().mean() < 0.1 * full.abs().mean()  # inverted dropout is unbiased


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_problems(backend, gen):
    q = torch.randn(2, 4, 7, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 0, 16, requires_grad=True)
    v = torch.randn(2, 2, 0, 8, requires_grad=True)
    reasons = refusal(backend, q, k, v)
    if reasons:
        assert any("empty problem" in r for r in reasons)
        with pytest.raises(BackendUnavailableError, match="empty problem"):
            attention(q, k, v, backend=backend)
        return
    out, lse = attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == (2, 4, 7, 8) and (out == 0).all() and (lse == float("-inf")).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()
    out = attention(torch.randn(0, 4, 7, 16), torch.randn(0, 2, 5, 16), torch.randn(0, 2, 5, 16), backend=backend)
    assert out.shape == (0, 4, 7, 16)
    out = attention(torch.randn(1, 4, 0, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), backend=backend)
    assert out.shape == (1, 4, 0, 16)


def test_auto_choice_serves_empty_problems():
    out = attnforge.attention(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 0, 8), torch.randn(1, 1, 0, 8))
    assert (out == 0).all() and out.shape == (1, 1, 3, 8)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "50"])
def test_a_bad_softcap_is_named(bad):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError, match="softcap must be"):
        attention(q, q, q, softcap=bad)


def test_softcap_is_served_where_declared_and_refused_with_the_reason_elsewhere():
    d = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, softcap=50.0, needs_grad=True)
    # cute_sm90 has SOFTCAP forward and backward kernels
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90")
    assert d.forward.variant.softcap and d.backward.variant.softcap and "+softcap" in d.forward.describe()
    assert "+softcap" in d.backward.describe()
    forced = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, causal=True, softcap=50.0,
                     alibi=True, needs_grad=True, backend="cute_sm90")
    assert forced.backward.backend == "cute_sm90" and "+softcap+alibi" in forced.backward.describe()
    assert "softcap is not supported" in d.forward.reasons_of("sdpa")
    fp8 = explain(device="H100", dtype="fp8", head_dim=128, seqlen_q=4096, softcap=50.0)
    assert "its fp8 kernel has no sliding window, softcap, sinks or ALiBi" in " ".join(fp8.forward.reasons_of("cute_sm90"))
    b200 = explain(device="B200", dtype="bf16", head_dim=128, seqlen_q=4096, softcap=50.0)
    assert b200.forward.backend == "cute_sm100" and b200.forward.variant.softcap
    assert "softcap" in d.problem.describe()
    cpu = explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=100, softcap=50.0)
    assert cpu.forward.backend == "reference"
    assert explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=100, softcap=0.0).forward.backend == "sdpa"


@pytest.mark.parametrize("entry", ["attention", "attention_varlen", "attention_with_kvcache", "explain"])
@pytest.mark.parametrize("cap", [0.0, 30.0, SMALL_SOFTCAP, 60.0])
def test_every_entry_point_says_whether_the_cap_is_above_the_small_softcap(entry, cap, gen):
    """Problem.softcap_large (a cap too wide for one fixed softmax offset: cute_sm90's FIXED_MAX) from the value."""
    q, k, v = (torch.randn(1, 17, 2, 16, generator=gen) for _ in range(3))  # (batch, seqlen, heads, dim)
    if entry == "attention":
        attention(q, k, v, softcap=cap, layout="bshd")
    elif entry == "attention_varlen":
        cu = torch.tensor([0, 17], dtype=torch.int32)
        attnforge.attention_varlen(q[0], k[0], v[0], cu, cu, 17, 17, softcap=cap)
    elif entry == "attention_with_kvcache":
        attnforge.attention_with_kvcache(q[:, :1], k, v, softcap=cap)
    problem = (explain(q, k, v, layout="bshd", softcap=cap) if entry == "explain" else last_decision()).problem
    assert (problem.softcap, problem.softcap_large) == (cap > 0, cap > SMALL_SOFTCAP)


def test_softcap_matches_fp64_math_and_gradcheck_on_the_reference(gen):
    q = torch.randn(2, 4, 17, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 23, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = attention(q, k, v, causal=True, softcap=0.7, backend="reference", return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, causal=True, softcap=0.7)
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    plain = attention(q, k, v, causal=True, backend="reference")
    assert (plain - ref).abs().max() > 1e-3  # the cap changes the answer
    small = [t.detach()[:1, :, :7, :4].clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal=True, softcap=0.7, window_size=(5, 0),
                                                       backend="reference", return_lse=True), small)


@pytest.mark.parametrize("bad, match", [(torch.zeros(3), r"shape \(heads_q,\) = \(2,\)"),
                                        (torch.zeros(2, dtype=torch.int32), "float tensor"),
                                        ([0.0, 1.0], "float tensor"), (torch.zeros(1, 2), "float tensor")])
def test_bad_sinks_are_named(bad, match):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError, match=match):
        attention(q, q, q, sinks=bad)


def test_sinks_are_served_where_declared_and_refused_with_the_reason_elsewhere():
    d = explain(device="H100", dtype="bf16", head_dim=64, seqlen_q=4096, causal=True, sinks=True, needs_grad=True)
    # cute_sm90's forward has a SINKS kernel; its backward needs none (P from the LSE, which counts the sink)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90")
    assert d.forward.variant.sinks and "+sinks" in d.forward.describe()
    assert "attention sinks are not supported" in d.forward.reasons_of("sdpa")
    a100 = explain(device="A100", dtype="bf16", head_dim=64, seqlen_q=4096, causal=True, sinks=True)
    assert a100.forward.backend == "triton_fa2" and a100.forward.variant.sinks
    assert explain(device="cpu", dtype="fp32", head_dim=64, seqlen_q=100, sinks=True).forward.backend == "reference"


def test_sinks_match_fp64_math_with_their_gradient_and_gradcheck(gen):
    """The LSE counts the sink; a row that sees no key gives 0 with LSE = its sink; dsinks is the gradient of
    both outputs (the LSE's too)."""
    q = torch.randn(2, 4, 29, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 23, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    out, lse = attention(q, k, v, causal=True, sinks=sinks, backend="reference", return_lse=True)
    ref, ref_lse, _ = oracle(q, k, v, causal=True, sinks=sinks)
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    assert (out[:, :, :6] == 0).all() and torch.equal(lse[:, :, :6], sinks.detach()[None, :, None].expand(2, 4, 6))
    dout, dlse = torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                        dtype=torch.float64)
    grads = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    _, _, ref_grads = oracle(q, k, v, causal=True, sinks=sinks, dout=dout, dlse=dlse)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-10)
    small = [t.detach()[:1, :, :7, :4].clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.gradcheck(lambda q, k, v, s: attention(q, k, v, window_size=(3, 2), sinks=s, backend="reference",
                                                          return_lse=True), (*small, sinks))


def test_explain_takes_sinks_on_the_command_line(capsys):
    from attnforge.cli import main

    assert main(["explain", "--device", "H100", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "4096",
                 "--sinks", "--json"]) == 0
    assert "sinks" in capsys.readouterr().out


def test_alibi_is_flash_attentions_bias_written_out(gen):
    """-slope * |i + Nk - Nq - j| on the scaled (capped) scores, per (batch, head) or per head, written out here
    independently of the reference's code; the LSE includes the bias; gradcheck through it."""
    b, h, nq, nk, d = 2, 2, 5, 7, 4
    q = torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, 1, nk, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.125]], dtype=torch.float64)
    bias = torch.tensor([[[[-slopes[bb, hh].item() * abs(i + nk - nq - j) for j in range(nk)] for i in range(nq)]
                          for hh in range(h)] for bb in range(b)], dtype=torch.float64)
    s = q @ k.transpose(-1, -2) * 0.7 + bias
    s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))  # causal
    want, want_lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    out, lse = attention(q, k, v, causal=True, scale=0.7, alibi_slopes=slopes, backend="reference", return_lse=True)
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    per_head = attention(q, k, v, scale=0.7, alibi_slopes=slopes[0], backend="reference")
    assert torch.allclose(per_head, attention(q, k, v, scale=0.7, alibi_slopes=slopes[0].expand(b, h),
                                              backend="reference"), atol=0)
    torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal=True, alibi_slopes=slopes, softcap=1.5,
                                                       backend="reference", return_lse=True), (q, k, v))
    with pytest.raises(InvalidInputError, match=r"alibi_slopes must be a float tensor of shape \(heads_q,\) = \(2,\)"):
        attention(q, k, v, alibi_slopes=torch.ones(3))
    d = explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, alibi=True, needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90") and d.forward.variant.alibi
    assert d.backward.variant.alibi
    assert "ALiBi is not supported" in d.forward.reasons_of("sdpa")

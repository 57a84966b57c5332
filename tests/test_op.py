"""attention() under torch.compile(fullgraph=True): one custom op, checked by torch.library.opcheck."""

import pytest
import torch

import attnforge
from attnforge.backends.reference import math_attention
from attnforge.testing import assert_close, oracle, peer_error


def fwd_args(q, k, v, causal, backend, needs_grad=True, return_lse=True, attn_mask=None, top_left=False):
    """attnforge::attention's arguments, scale 0.25."""
    return (q, k, v, attn_mask, causal, top_left, -1, -1, 0.25, needs_grad, return_lse, backend)


def bwd_args(dout, q, k, v, out, lse, dlse, causal, backend, attn_mask=None, top_left=False):
    """attnforge::attention_backward's arguments, scale 0.25."""
    return (dout, q, k, v, attn_mask, out, lse, dlse, causal, top_left, -1, -1, 0.25, dlse is not None, backend)


def qkv(gen, requires_grad=True):
    shapes = ((2, 4, 17, 16), (2, 2, 17, 16), (2, 2, 17, 16))
    return [torch.randn(*s, generator=gen).requires_grad_(requires_grad) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_opcheck(causal, backend, gen):
    q, k, v = qkv(gen)
    torch.library.opcheck(torch.ops.attnforge.attention.default, fwd_args(q, k, v, causal, backend))
    dout, out, lse = torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 4, 17, generator=gen)
    for dlse in (None, torch.randn(2, 4, 17, generator=gen)):
        torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                              bwd_args(dout, q.detach(), k.detach(), v.detach(), out, lse, dlse, causal, backend))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, k, v):
        q = self.proj(x).transpose(1, 2)  # (b, s, h, d) -> bshd through the layout argument below
        return attnforge.attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True, layout="bshd").transpose(1, 2)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_and_fp64(compiler, gen):
    torch.manual_seed(0)
    block = Block()
    x, k, v = qkv(gen)
    compiled = torch.compile(block, fullgraph=True, backend=compiler)
    out = compiled(x, k, v)
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (x, k, v), dout)
    q = block.proj(x).detach()
    ref, _, ref_grads = oracle(q, k, v, causal=True, dout=dout)
    peer, peer_grads = peer_error(q, k, v, causal=True, dout=dout)
    assert_close("out", out, ref, peer, ulps=32)
    for name, g, r, p in zip(("dk", "dv"), grads[1:], ref_grads[1:], peer_grads[1:]):
        assert_close(name, g, r, p, ulps=32)
    eager = torch.autograd.grad(block(x, k, v), (x, k, v), dout)
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_dropout_under_compile_says_so(gen):
    q, k, v = qkv(gen, requires_grad=False)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, dropout_p=0.1), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="dropout_p > 0 inside torch.compile is not supported yet"):
        fn(q, k, v)


def test_forced_autograd_native_backend_under_compile_matches_eager(gen):
    """A forced sdpa (torch autograd through its forward) used to be refused under compile: the op's backward
    now runs its forward again under autograd."""
    q, k, v = qkv(gen)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True, backend="sdpa"), fullgraph=True,
                       backend="aot_eager")
    out = fn(q, k, v)
    assert attnforge.last_decision().backward.backend == "sdpa"
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager = attnforge.attention(q, k, v, causal=True, backend="sdpa")
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_double_backward_through_the_op_is_a_clear_error(backend, gen):
    """The op's backward is a kernel (another op): differentiating the gradient raises attnforge's error
    naming the remedy (it used to be torch's "no autograd formula"); under torch.compile, torch's AOT
    autograd refuses double backward itself, saying so."""
    q, k, v = (t.double() for t in qkv(gen))
    out, _ = torch.ops.attnforge.attention(*fwd_args(q, k, v, True, backend))
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(attnforge.BackendUnavailableError, match=r"second-order gradients .*backend='sdpa'"):
        torch.autograd.grad(dq.sum(), k)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True, backend=backend), fullgraph=True,
                       backend="aot_eager")
    out = fn(q, k, v)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward"):
        torch.autograd.grad(dq.sum(), k)


def layouts(gen, layout):
    """q, k, v in (batch, heads, seqlen, dim) order whose storage is not: "bshd" (attention's layout="bshd"
    view) or "view_transpose" (the ``x.view(b, s, h, d).transpose(1, 2)`` every Hugging Face model passes,
    here with q from a wider projection so its strides are not dense either)."""
    if layout == "bshd":
        return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(gen, requires_grad=False)]
    q = torch.randn(2, 17, 4 * 16 + 8, generator=gen)[..., :64].view(2, 17, 4, 16).transpose(1, 2)
    k, v = (torch.randn(2, 17, 2 * 16, generator=gen).view(2, 17, 2, 16).transpose(1, 2) for _ in range(2))
    return [q, k, v]


@pytest.mark.parametrize("layout", ["bshd", "view_transpose"])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_opcheck_on_non_contiguous_inputs(layout, backend, gen):
    """The fakes give the real ops' strides and dtypes: the backward's fake used to be empty_like(q) (q's
    strides) while the op returns contiguous gradients, which inductor's stride assertion caught."""
    q, k, v = (t.requires_grad_() for t in layouts(gen, layout))
    assert not q.is_contiguous()
    torch.library.opcheck(torch.ops.attnforge.attention.default, fwd_args(q, k, v, True, backend))
    out, lse = torch.ops.attnforge.attention(*fwd_args(q.detach(), k.detach(), v.detach(), True, backend))
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    for d in (dlse, None):
        torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                              bwd_args(dout, q.detach(), k.detach(), v.detach(), out, lse, d, True, backend))


@pytest.mark.parametrize("layout", ["bshd", "view_transpose"])
def test_fakes_match_the_real_ops_strides_and_dtypes(layout, gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = layouts(gen, layout)
    for needs_grad, return_lse, backend in ((True, True, None), (True, False, "reference"), (False, False, None)):
        real = torch.ops.attnforge.attention(*fwd_args(q, k, v, False, backend, needs_grad, return_lse))
        dout = torch.randn(real[0].shape, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
        real_grads = torch.ops.attnforge.attention_backward(*bwd_args(dout, q, k, v, *real, None, False, backend))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fq, fk, fv, fdout = (mode.from_tensor(t) for t in (q, k, v, dout))
            fake = torch.ops.attnforge.attention(*fwd_args(fq, fk, fv, False, backend, needs_grad, return_lse))
            fake_grads = torch.ops.attnforge.attention_backward(*bwd_args(fdout, fq, fk, fv, *fake, None, False,
                                                                          backend))
        for f, r in zip((*fake, *fake_grads), (*real, *real_grads)):
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_lse_is_differentiable_through_the_op(backend, gen):
    """gradcheck through out and lse together: the LSE term used to be dropped (dlse ignored)."""
    q, k, v = (t.double().requires_grad_() for t in (x[:1, :, :7, :8] for x in qkv(gen, requires_grad=False)))

    w_out, w_lse = torch.randn(1, 4, 7, 8, generator=gen).double(), torch.randn(1, 4, 7, generator=gen).double()

    def f(q, k, v):  # one output that needs both terms (gradcheck skips an output that needs no grad)
        out, lse = torch.ops.attnforge.attention(q, k, v, None, True, False, -1, -1, 0.3, True, True, backend)
        return (out * w_out).sum() + (lse * w_lse).sum()

    torch.autograd.gradcheck(f, (q, k, v))
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True, return_lse=True, backend=backend),
                       fullgraph=True, backend="aot_eager")
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = math_attention(q64, k64, v64, causal=True)
    want = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q64, k64, v64))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


def test_opcheck_with_an_attn_mask_and_top_left_causal(gen):
    """attnforge.sdpa's masks reach the op: an explicit attn_mask, and SDPA's top-left is_causal (nq != nk)."""
    q, k, v = qkv(gen)
    mask = torch.rand(2, 1, 17, 17, generator=gen) > 0.3
    torch.library.opcheck(torch.ops.attnforge.attention.default, fwd_args(q, k, v, False, None, False, False,
                                                                           attn_mask=mask))
    # With grad, the LSE output of a backend that gives none (sdpa) is NaN, unused (return_lse is False) and
    # never returned; opcheck's AOT comparison has no equal_nan, so it checks the rest here: the compiled
    # tests below compare outputs and gradients with eager.
    torch.library.opcheck(torch.ops.attnforge.attention.default, fwd_args(q, k, v, False, None, True, False,
                                                                           attn_mask=mask),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    q5 = q[:, :, :5].detach().requires_grad_()
    torch.library.opcheck(torch.ops.attnforge.attention.default, fwd_args(q5, k, v, True, None, top_left=True))


def compiled_and_eager_sdpa(gen, attn_mask=None, is_causal=False, seqlen_q=17):
    q, k, v = qkv(gen)
    q = q[:, :, :seqlen_q].detach().requires_grad_()

    def f(q, k, v):
        return attnforge.sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)

    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    out = torch.compile(f, fullgraph=True)(q, k, v)
    compiled_decision = attnforge.last_decision()
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager = f(q, k, v)
    assert attnforge.last_decision() is compiled_decision  # the compiled call took eager's Decision
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=1e-5)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    return compiled_decision


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_sdpa_with_a_mask_compiles_fullgraph_and_matches_eager(mask_dtype, gen):
    """attnforge.sdpa with an attn_mask used to break the graph 7 times (the self-check's .item(), ContextVar.get)."""
    mask = torch.rand(2, 1, 17, 17, generator=gen) > 0.3
    if mask_dtype is torch.float32:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) + torch.randn(mask.shape, generator=gen)
    decision = compiled_and_eager_sdpa(gen, attn_mask=mask)
    assert decision.problem.mask.tensor and decision.problem.needs_grad


def test_sdpa_top_left_causal_compiles_fullgraph_and_matches_eager(gen):
    decision = compiled_and_eager_sdpa(gen, is_causal=True, seqlen_q=5)
    assert decision.problem.mask.top_left


def test_compiled_calls_decide_as_eager_and_are_reported(gen):
    """Forward and backward come from the Decision an eager call with the same inputs takes, no_grad included,
    and last_decision() / decisions() report them."""
    q, k, v = qkv(gen)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    attnforge.dispatch.clear_caches()
    with torch.no_grad():
        fn(q, k, v)
    inference = attnforge.last_decision()
    assert inference is not None and not inference.problem.needs_grad and inference.backward is None
    fn(q, k, v)
    training = attnforge.last_decision()
    assert training.problem.needs_grad and training.backward.backend is not None
    assert set(attnforge.decisions()) == {inference, training}
    with torch.no_grad():
        attnforge.attention(q, k, v, causal=True)
    assert attnforge.last_decision() is inference
    attnforge.attention(q, k, v, causal=True)
    assert attnforge.last_decision() is training


def test_a_non_finite_scale_under_compile_is_a_clear_error(gen):
    q, k, v = qkv(gen, requires_grad=False)
    fn = torch.compile(lambda q, k, v, s: attnforge.attention(q, k, v, scale=s), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="scale must be a finite number"):
        fn(q, k, v, float("nan"))


FEATURES = {
    "softcap": lambda gen: dict(softcap=0.7),
    "sinks": lambda gen: dict(sinks=torch.randn(4, generator=gen).requires_grad_()),
    "alibi": lambda gen: dict(alibi_slopes=torch.rand(4, generator=gen)),
    "all": lambda gen: dict(softcap=2.0, sinks=torch.randn(4, generator=gen).requires_grad_(),
                            alibi_slopes=torch.rand(2, 4, generator=gen), window_size=(5, 3)),
    "deterministic": lambda gen: dict(deterministic=True),
}


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("feature", FEATURES)
def test_score_features_and_deterministic_compile_fullgraph_and_match_eager(feature, compiler, gen):
    """softcap, sinks (with their gradient), ALiBi and deterministic=True through the op: the compiled step's
    outputs, LSE and gradients equal the eager call's, whose own correctness tests/test_api.py checks against fp64."""
    torch._dynamo.reset()  # (each case traces the same code object anew: no recompile limit across cases)
    q, k, v = qkv(gen)
    kw = FEATURES[feature](gen)

    def step(q, k, v):
        return attnforge.attention(q, k, v, causal=True, return_lse=True, **kw)

    out, lse = torch.compile(step, fullgraph=True, backend=compiler)(q, k, v)
    decision = attnforge.last_decision()
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    eager_out, eager_lse = step(q, k, v)
    assert attnforge.last_decision() == decision  # the same Decision as the eager call
    eager = torch.autograd.grad((eager_out, eager_lse), leaves, (dout, dlse))
    torch.testing.assert_close(out, eager_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, eager_lse, atol=1e-6, rtol=1e-6)
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_opcheck_with_score_features(gen):
    q, k, v = qkv(gen)
    sinks, slopes = torch.randn(4, generator=gen), torch.rand(2, 4, generator=gen)
    torch.library.opcheck(torch.ops.attnforge.attention.default,
                          (*fwd_args(q, k, v, True, "reference"), 0.7, sinks, slopes, True))
    dout, out, lse = (torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 4, 17, 16, generator=gen),
                      torch.randn(2, 4, 17, generator=gen))
    torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                          (*bwd_args(dout, q.detach(), k.detach(), v.detach(), out, lse, None, True, "reference"),
                           0.7, sinks, slopes, True))


"""attention() under torch.compile(fullgraph=True): one custom op, checked by torch.library.opcheck."""

import pytest
import torch

import attnforge
from attnforge.backends.reference import math_attention
from attnforge.testing import assert_close, oracle, peer_error


def qkv(gen, requires_grad=True):
    shapes = ((2, 4, 17, 16), (2, 2, 17, 16), (2, 2, 17, 16))
    return [torch.randn(*s, generator=gen).requires_grad_(requires_grad) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_opcheck(causal, backend, gen):
    q, k, v = qkv(gen)
    torch.library.opcheck(torch.ops.attnforge.attention.default, (q, k, v, causal, 0.25, backend))
    dout, out, lse = torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 4, 17, generator=gen)
    for dlse in (None, torch.randn(2, 4, 17, generator=gen)):
        torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                              (dout, q.detach(), k.detach(), v.detach(), out, lse, dlse, causal, 0.25, backend))


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


def test_forced_autograd_native_backend_under_compile_says_why(gen):
    q, k, v = qkv(gen)
    fn = torch.compile(lambda q, k, v: attnforge.attention(q, k, v, backend="sdpa"), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="backward runs from the saved output and LSE"):
        fn(q, k, v)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_double_backward_through_the_op_is_a_clear_error(backend, gen):
    """The op's backward is a kernel (another op): differentiating the gradient raises attnforge's error
    naming the remedy (it used to be torch's "no autograd formula"); under torch.compile, torch's AOT
    autograd refuses double backward itself, saying so."""
    q, k, v = (t.double() for t in qkv(gen))
    out, _ = torch.ops.attnforge.attention(q, k, v, True, 0.25, backend)
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
    torch.library.opcheck(torch.ops.attnforge.attention.default, (q, k, v, True, 0.25, backend))
    out, lse = torch.ops.attnforge.attention(q.detach(), k.detach(), v.detach(), True, 0.25, backend)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    for d in (dlse, None):
        torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                              (dout, q.detach(), k.detach(), v.detach(), out, lse, d, True, 0.25, backend))


@pytest.mark.parametrize("layout", ["bshd", "view_transpose"])
def test_fakes_match_the_real_ops_strides_and_dtypes(layout, gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = layouts(gen, layout)
    real = torch.ops.attnforge.attention(q, k, v, False, 0.25, None)
    dout = torch.randn(real[0].shape, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
    real_grads = torch.ops.attnforge.attention_backward(dout, q, k, v, *real, None, False, 0.25, None)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, fdout = (mode.from_tensor(t) for t in (q, k, v, dout))
        fake = torch.ops.attnforge.attention(fq, fk, fv, False, 0.25, None)
        fake_grads = torch.ops.attnforge.attention_backward(fdout, fq, fk, fv, *fake, None, False, 0.25, None)
    for f, r in zip((*fake, *fake_grads), (*real, *real_grads)):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_lse_is_differentiable_through_the_op(backend, gen):
    """gradcheck through out and lse together: the LSE term used to be dropped (dlse ignored)."""
    q, k, v = (t.double().requires_grad_() for t in (x[:1, :, :7, :8] for x in qkv(gen, requires_grad=False)))

    w_out, w_lse = torch.randn(1, 4, 7, 8, generator=gen).double(), torch.randn(1, 4, 7, generator=gen).double()

    def f(q, k, v):  # one output that needs both terms (gradcheck skips an output that needs no grad)
        out, lse = torch.ops.attnforge.attention(q, k, v, True, 0.3, backend)
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

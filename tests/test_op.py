"""attention() under torch.compile(fullgraph=True): one custom op, checked by torch.library.opcheck."""

import pytest
import torch

import attnforge
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
    torch.library.opcheck(torch.ops.attnforge.attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, 0.25, backend))


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

"""attention() and attnforge.sdpa under torch.autocast behave as torch's SDPA does: the fp32/fp16/bf16 inputs
run in the autocast dtype (a Qwen3-style step leaves q and k in fp32 after QK-norm while v is bf16), the
Decision sees that dtype, gradients flow back to the inputs' own dtypes, and outside autocast mixed dtypes
stay an error. CPU autocast (bf16) here; the CUDA path is the same code."""

import pytest
import torch
import torch.nn.functional as F

import attnforge
from attnforge import InvalidInputError


def _qwen3_style(gen, requires_grad=False):
    q, k = (torch.randn(2, 4, 17, 32, generator=gen).requires_grad_(requires_grad) for _ in range(2))  # fp32
    v = torch.randn(2, 4, 17, 32, generator=gen).bfloat16().requires_grad_(requires_grad)
    return q, k, v


@pytest.mark.parametrize("backend", [None, "sdpa", "reference"])
def test_mixed_inputs_run_in_the_autocast_dtype(backend, gen):
    q, k, v = _qwen3_style(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnforge.attention(q, k, v, causal=True, backend=backend)
    assert attnforge.last_decision().problem.dtype == "bf16"
    expected = attnforge.attention(q.bfloat16(), k.bfloat16(), v, causal=True, backend=backend)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_the_reference_keeps_its_fp32_accumulation_under_autocast(gen):
    """autocast lowers fp32 matmuls to bf16: inside the reference backend it is switched off."""
    q, k, v = (t.bfloat16() for t in _qwen3_style(gen))
    outside = attnforge.attention(q, k, v, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = attnforge.attention(q, k, v, backend="reference")
    assert torch.equal(inside, outside)


def test_gradients_reach_the_inputs_in_their_own_dtypes(gen):
    q, k, v = _qwen3_style(gen, requires_grad=True)
    dout = torch.randn(2, 4, 17, 32, generator=gen).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnforge.attention(q, k, v, causal=True, backend="reference")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(attnforge.attention(q16, k16, v16, causal=True, backend="reference"), (q16, k16, v16), dout)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e.to(g.dtype))  # the cast's backward is a cast


def test_sdpa_drop_in_matches_torch_under_autocast(gen):
    q, k, v = _qwen3_style(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attnforge.sdpa(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_outside_autocast_mixed_dtypes_stay_an_error(gen):
    q, k, v = _qwen3_style(gen)
    with pytest.raises(InvalidInputError, match="bfloat16"):
        attnforge.attention(q, k, v)


def test_fp64_inputs_are_not_cast(gen):
    q, k, v = (t.double() for t in _qwen3_style(gen))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnforge.attention(q, k, v)
    assert out.dtype == torch.float64


def test_compiled_under_autocast_matches_eager(gen):
    q, k, v = _qwen3_style(gen)
    fn = torch.compile(lambda a, b, c: attnforge.attention(a, b, c, causal=True, backend="reference"),
                       fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = fn(q, k, v)
        eager = attnforge.attention(q, k, v, causal=True, backend="reference")
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager)

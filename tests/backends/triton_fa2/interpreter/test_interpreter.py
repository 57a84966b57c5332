"""triton_fa2's generated kernels in Triton's interpreter, on CPU tensors, against fp64 math.

TRITON_INTERPRET is read when a kernel is decorated, so this file runs in a pytest process of its
own with TRITON_INTERPRET=1 (tests/backends/triton_fa2/test_interpreter_suite.py starts it).
fp16 and fp32 only: the interpreter's bf16 tl.dot multiplies raw bit patterns (triton-lang/triton
issue 11584), so bf16 numerics are checked on the GPU (tests/test_api.py's cuda cases).
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 in its own process (test_interpreter_suite starts it)")

from attnforge import attention, explain, use_backend  # noqa: E402
from attnforge.codegen import Source  # noqa: E402
from attnforge.dispatch import registered  # noqa: E402
from attnforge.runtime import generated  # noqa: E402
from attnforge.testing import assert_close, oracle, peer_error  # noqa: E402

# Every module either Triton backend can pick, on any arch (triton_rocm's are triton_fa2's kernels with
# AMD tiles and compile options, which the interpreter ignores; the tiles still change the loops),
# rendered from its backend's template into the cache as at run time.
BACKENDS = [registered()[name] for name in ("triton_fa2", "triton_rocm")]
FWD_TILES = [(b, "fwd", t) for b in BACKENDS for t in b.variants_table.all_tiles()[0]]
BWD_TILES = [(b, "bwd", t) for b in BACKENDS for t in b.variants_table.all_tiles()[1]]
# the KV-cache kernel's tiles, one per (backend, tile) whatever arch, head dim or row count picks it (test_kvcache.py)
KV_TILES = list(dict.fromkeys((b, "kvcache", v.tile) for b in BACKENDS
                              for v in b.variants(features=(frozenset({"kvcache"}),)) if v.family == "kvcache"))


def module(entry):
    backend, family, tile = entry
    return generated.load(Source.of(backend.templates[family], tile.params(), tile.module))


def launch_window(mask):
    """A Mask's window as the kernels' launch takes it (None: unwindowed)."""
    return mask.window_bounds if mask.windowed else None


def feature_case_id(c):
    """A score-feature case (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap, ...) as an id."""
    return f"{c[0]}x{c[1]}x{c[2]}x{c[3]}x{c[4]}{'-causal' if c[5] else ''}-w{c[6][0]}_{c[6][1]}-cap{c[7]}"


def tile_id(entry):
    return f"{entry[0].name}.{entry[2].module}"


def test_every_variant_the_backends_plan_is_covered():
    """The tiles above are what the planner can pick: every variant's module, and no other."""
    covered = {(b.name, family, t) for b, family, t in FWD_TILES + BWD_TILES + KV_TILES}
    assert covered == {(b.name, v.family, v.tile) for b in BACKENDS
                       for v in b.variants(features=(frozenset({"kvcache"}),))}


def inputs(gen, b, hq, hkv, nq, nk, d, dtype, layout="bhsd"):
    def rand(h, n):
        t = torch.randn(b, h, n, d, generator=gen).to(dtype)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else t
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk)


# (heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal): odd lengths, GQA/MQA, padded head dims,
# causal with seqlen_q > seqlen_k (rows that see no key) and seqlen_q < seqlen_k.
CASES = [(2, 1, 113, 67, 64, True), (4, 2, 17, 130, 96, True), (2, 2, 1, 1, 32, False), (3, 1, 129, 129, 64, False)]


@pytest.mark.parametrize("tile", FWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_fp32_every_tile(tile, case, gen):
    """fp32 in the interpreter is exact math: the kernel's online softmax must match fp64 closely."""
    hq, hkv, nq, nk, d, causal = case
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32, layout="bshd")
    out = torch.full_like(q, float("nan"))  # poisoned: unwritten elements show
    lse = torch.full(q.shape[:3], float("nan"))
    module(tile).launch(q, k, v, out, lse, causal=causal, scale=0.3)
    ref, ref_lse, _ = oracle(q, k, v, causal=causal, scale=0.3)
    peer, _ = peer_error(q, k, v, causal=causal, scale=0.3)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)


@pytest.mark.parametrize("tile", BWD_TILES, ids=tile_id)
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "x".join(map(str, c)))
def test_backward_fp32_every_tile(tile, case, gen):
    hq, hkv, nq, nk, d, causal = case
    q, k, v = inputs(gen, 1, hq, hkv, nq, nk, d, torch.float32)
    dout = torch.randn(q.shape, generator=gen)
    ref, ref_lse, ref_grads = oracle(q, k, v, causal=causal, scale=0.3, dout=dout)
    _, peer_grads = peer_error(q, k, v, causal=causal, scale=0.3, dout=dout)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    module(tile).launch(q, k, v, ref.float(), ref_lse.float(), dout, *grads, causal=causal, scale=0.3)
    # sqrt(reduction length) units of rounding, plus the LSE's own: the kernel recomputes P = exp(S - LSE)
    # from an fp32 LSE, which puts eps32 * |LSE| relative error on every P (a 1-in-30 seed exceeded the
    # bound without it: dv 2.28e-5 > 2.15e-5 with ATTNFORGE_TEST_SEED=15)
    ulps = 4 * math.sqrt(max(nq, nk, d)) + ref_lse[torch.isfinite(ref_lse)].abs().max().item()
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert_close(name, g, r, p, ulps=ulps)


@pytest.mark.parametrize("backend", ["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_attention_fp16_forward_and_backward(backend, case, gen):
    """The public call, forced to a Triton backend on CPU tensors: fp16 against fp64, within 2x PyTorch's own fp16 error."""
    hq, hkv, nq, nk, d, causal = case
    q, k, v = (t.requires_grad_() for t in inputs(gen, 2, hq, hkv, nq, nk, d, torch.float16, layout="bshd"))
    args = [t.transpose(1, 2) for t in (q, k, v)]
    decision = explain(*args, layout="bshd", causal=causal, needs_grad=True, backend=backend)
    assert decision.forward.backend == backend and decision.backward.backend == backend
    with use_backend(backend):
        out, lse = attention(*args, causal=causal, layout="bshd", return_lse=True)
    out = out.transpose(1, 2)
    dout = torch.randn(out.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse, ref_grads = oracle(q, k, v, causal=causal, dout=dout)
    peer, peer_grads = peer_error(q, k, v, causal=causal, dout=dout)
    ulps = 4 * math.sqrt(max(nq, nk, d))
    assert_close("out", out, ref, peer, ulps=ulps)
    assert_close("lse", lse, ref_lse, ref_lse.float(), ulps=ulps)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert_close(name, g, r, p, ulps=ulps)
    if causal and nq > nk:
        assert (out[:, :, : nq - nk] == 0).all() and (lse[:, :, : nq - nk] == float("-inf")).all()

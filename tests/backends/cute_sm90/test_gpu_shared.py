"""On an H100/H200: cute_sm90 kernels loaded from their linked shared libraries (through TVM FFI, without the
CuTe DSL) compute what fp64 math does. `attnforge build` fills a fresh cache; a fresh process loads from it with
shared loading on, runs the forward and the backward through attention() and checks them against fp64 math; the
CuTe DSL must not have been imported. (The same kernels' poisoned-output tests are test_gpu.py and
test_gpu_backward.py, which launch them compiled in memory.)"""

import os
import subprocess
import sys

import pytest

from attnforge.runtime import cute
from attnforge.testing import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu((9, 0), "sm90")]

CHILD = r"""
import math, sys, torch, attnforge
from attnforge.testing import assert_close, oracle, peer_error

gen = torch.Generator().manual_seed(0)
for head_dim in (64, 128):
    for causal in (False, True):
        for b, hq, hkv, nq, nk in ((1, 2, 2, 1, 1), (2, 4, 2, 113, 1023), (1, 4, 4, 1023, 113)):
            q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to("cuda", torch.bfloat16)
                       for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
            dout = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = attnforge.attention(q, k, v, causal=causal, backend="cute_sm90")
            out.backward(dout)
            decision = attnforge.last_decision()
            assert decision.forward.backend == decision.backward.backend == "cute_sm90", decision
            ref, _, ref_grads = oracle(q.detach(), k.detach(), v.detach(), causal=causal, dout=dout)
            peer, peer_grads = peer_error(q.detach(), k.detach(), v.detach(), causal=causal, dout=dout)
            ulps = 4 * math.sqrt(max(nk, head_dim))
            assert_close("out", out, ref, peer, ulps=ulps)
            for name, g, r, p in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads, peer_grads):
                assert_close(name, g, r, p, ulps=4 * ulps)
print("cutlass imported:", "cutlass" in sys.modules)
"""


def test_kernels_from_shared_libraries_match_fp64(tmp_path):
    cache = tmp_path / "cache"
    build = subprocess.run([sys.executable, "-m", "attnforge", "build", "--target", "sm90", "--backend", "cute_sm90",
                            "--dtype", "bf16", "--head-dim", "64,128", "--out", str(cache)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    libraries = sorted(cache.rglob("*.so"))
    assert libraries, f"the build linked no shared library (no C compiler?): {build.stdout[-2000:]}"
    env = {**os.environ, "ATTNFORGE_CACHE_DIR": str(cache), cute.SHARED_ENV: "1"}
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    assert "cutlass imported: False" in child.stdout, child.stdout + child.stderr[-2000:]

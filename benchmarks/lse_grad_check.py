"""Gradients through attention()'s output and LSE on the local GPU against fp64 math, per backend that has its
own backward (the dLSE term of the backward): prints the max error of dq, dk, dv and PyTorch's own error in
the same dtype. Odd lengths, GQA, causal and not.

    python benchmarks/lse_grad_check.py [--dtype fp16] [--backends triton_fa2,cute_sm90]
"""

from __future__ import annotations

import argparse

import torch

import attnforge
from attnforge.testing import error_and_bound


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--backends", default="triton_fa2,cute_sm90")
    args = p.parse_args(argv)
    dtype = attnforge.dispatch.DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    failed = 0
    for backend in args.backends.split(","):
        for causal in (False, True):
            q, k, v = (torch.randn(2, h, n, 64, generator=g).to("cuda", dtype) for h, n in ((4, 113), (2, 177), (2, 177)))
            wo, wl = torch.randn(2, 4, 113, 64, generator=g).cuda(), torch.randn(2, 4, 113, generator=g).cuda()

            def grads(q, k, v, fn):
                q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
                out, lse = fn(q, k, v)
                ((out.float() * wo).sum() + (lse.float() * wl).sum()).backward()
                return q.grad, k.grad, v.grad

            got = grads(q, k, v, lambda a, b, c: attnforge.attention(a, b, c, causal=causal, return_lse=True, backend=backend))
            ref = grads(q.double(), k.double(), v.double(), lambda a, b, c: attnforge.math_attention(a, b, c, causal=causal))
            peer = grads(q, k, v, lambda a, b, c: attnforge.math_attention(a, b, c, causal=causal))
            for name, x, r, pe in zip(("dq", "dk", "dv"), got, ref, peer):
                err, bound, peer_err = error_and_bound(x, r, pe, ulps=4 * 177 ** 0.5)
                ok = err <= bound and not torch.isnan(x).any()
                failed += not ok
                print(f"{backend:10s} {'causal' if causal else 'full':6s} {name}: max error {err:.2e} (bound {bound:.2e}, "
                      f"torch {args.dtype} {peer_err:.2e}) {'ok' if ok else 'FAILED'}  [{attnforge.last_decision().backward.describe()}]")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CUDA kernels one training step (forward + backward) launches through attnforge's automatic choice and through
one backend forced, side by side (torch.profiler, one profiled step after three untimed ones; kernel names and CUDA
times): do two runners that measure apart run the same kernels? bf16, (batch, heads, seqlen, head_dim) inputs.

    python benchmarks/profile_auto_vs_forced.py [--backend sdpa] [--batch 4] [--heads 32] [--seqlen 4096]
        [--head-dim 80] [--causal]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import attnforge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    for label, kw in (("auto", {}), (args.backend, {"backend": args.backend})):
        print(attnforge.explain(q, k, v, causal=args.causal, needs_grad=True, **kw))
        for _ in range(3):
            attnforge.attention(q, k, v, causal=args.causal, **kw).backward(dout)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            attnforge.attention(q, k, v, causal=args.causal, **kw).backward(dout)
            torch.cuda.synchronize()
        print(f"== {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()

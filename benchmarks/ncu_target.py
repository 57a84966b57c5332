"""One cute_sm90 forward to profile with Nsight Compute (ncu): a warm-up call (compiles, self-checks),
then the profiled one. Nothing is timed here; ncu's report is the output.

    ncu --clock-control none -k regex:attnforge --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python benchmarks/ncu_target.py --dtype fp8 --head-dim 128
"""

from __future__ import annotations

import argparse

import torch

import attnforge


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="fp8", choices=("fp8", "bf16", "fp16"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    shape = (1, args.heads, args.seqlen, args.head_dim)
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    q, k, v = (torch.randn(shape, device="cuda").to(dtype) for _ in range(3))
    for _ in range(2):
        attnforge.attention(q, k, v, causal=args.causal, backend="cute_sm90")
    torch.cuda.synchronize()
    print(attnforge.last_decision().forward.describe())


if __name__ == "__main__":
    main()

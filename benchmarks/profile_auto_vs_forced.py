"""The CUDA kernels one training step (forward + backward) launches through attnforge's automatic choice and through
one backend forced, side by side (profile_step.kernel_us: torch.profiler after three untimed steps, each kernel's
mean device time per step): do two runners that measure apart run the same kernels? bf16, (batch, heads, seqlen,
head_dim) inputs.

    python benchmarks/profile_auto_vs_forced.py [--backend sdpa] [--batch 4] [--heads 32] [--seqlen 4096]
        [--head-dim 80] [--causal] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

import attnforge
from attnforge.bench import measure

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from profile_step import kernel_us  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(4))
    for label, kw in (("auto", {}), (args.backend, {"backend": args.backend})):
        print(attnforge.explain(q, k, v, causal=args.causal, needs_grad=True, **kw))
        step = measure.step(lambda q, k, v: attnforge.attention(q, k, v, causal=args.causal, **kw), q, k, v, dout,
                            "fwd+bwd")
        kernels = kernel_us(step, args.steps)
        print(f"== {label}: {sum(kernels.values()):.1f} us of kernels per step")
        print(json.dumps(kernels, indent=1))


if __name__ == "__main__":
    main()

"""Where a training step's GPU time goes: forward+backward of attnforge (backend cute_sm90), cuDNN's SDPA and
FlashAttention-4 under torch.profiler, each kernel's mean device time per step (bf16, fresh random inputs in
(batch, seqlen, heads, head_dim) order, 16k tokens, heads = 2048 / d). Kernel time, not model speed; the sum is
below the step's wall time by the gaps between kernels.

    python benchmarks/profile_step.py [--head-dim 128] [--seqlen 1024,4096] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

import attnforge
from attnforge.bench import impls, measure


def kernel_us(fn, steps: int) -> dict[str, float]:
    """{kernel name: mean microseconds per step} over ``steps`` steps after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time_total
    return {name: round(us / steps, 1) for name, us in totals.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="128")
    parser.add_argument("--seqlen", default="1024,4096")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    table, rows = impls.implementations(), []
    for d in map(int, args.head_dim.split(",")):
        for n in map(int, args.seqlen.split(",")):
            for causal in (False, True):
                b, h = max(args.tokens // n, 1), 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                scale = d ** -0.5

                def ours(q, k, v):
                    return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend="cute_sm90")

                fns = {"attnforge cute_sm90": ours, "sdpa-cudnn": table["sdpa-cudnn"].make(causal, scale),
                       "fa4": table["fa4"].make(causal, scale)}
                for name, fn in fns.items():
                    kernels = kernel_us(measure.step(fn, q, k, v, dout, "fwd+bwd"), args.steps)
                    row = {"impl": name, "head_dim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal,
                           "total_us": round(sum(kernels.values()), 1), "kernels_us": kernels}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": measure.environment(torch.device("cuda")), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

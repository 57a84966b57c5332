"""attnforge's training step through autograd (attention() forced to cute_sm90, then autograd.grad) beside the
direct path of benchmarks/sweep_bwd_sm90.py (the no-grad forward with its LSE, then backward.run of the variant the
Decision chose), at d=128 and 64, N=16k (16k tokens: batch 16384 / N), 2048/d heads, bf16, causal and not: wall time per step (median of 20
CUDA-event pairs, no L2 flush) and each path's GPU kernels under torch.profiler (5 steps). Both paths run the same
kernels; this shows what the autograd glue adds around them (launches, copies, waits).

    python benchmarks/autograd_vs_direct.py [--head-dim 128,64] [--seqlen 16384]
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import attnforge
from attnforge.backends.cute_sm90 import backward
from attnforge.bench import measure


def paths(d: int, n: int, causal: bool):
    b, h = max(16384 // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    dout, scale = torch.randn_like(q), d ** -0.5
    variant = attnforge.explain(q, k, v, causal=causal, layout="bshd", needs_grad=True, backend="cute_sm90").backward.variant
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def direct():
        with torch.no_grad():
            out, lse = attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", return_lse=True,
                                           backend="cute_sm90")
        return backward.run(variant, qt, kt, vt, out.transpose(1, 2), lse, dt, scale)

    def forward(q, k, v):
        return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend="cute_sm90")
    return {"direct": direct, "autograd": measure.step(forward, q, k, v, dout, "fwd+bwd")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="128,64")
    parser.add_argument("--seqlen", type=int, default=16384)
    args = parser.parse_args()
    for d in map(int, args.head_dim.split(",")):
        for causal in (True, False):
            for name, fn in paths(d, args.seqlen, causal).items():
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
                for _ in range(20):
                    start.record()
                    fn()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                print(f"== d={d} causal={causal} {name}: median {statistics.median(times):.3f} ms")
                kernels = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        count_time = kernels.setdefault(e.name[:90], [0, 0.0])
                        count_time[0] += 1
                        count_time[1] += getattr(e, "device_time", None) or e.cuda_time
                for kernel, (count, us) in sorted(kernels.items(), key=lambda x: -x[1][1]):
                    print(f"   {count / 5:4.1f}x {us / 5 / 1000:8.3f} ms  {kernel}")


if __name__ == "__main__":
    main()

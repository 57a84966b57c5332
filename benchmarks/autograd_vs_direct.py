"""attnforge's training step through autograd (attention() forced to cute_sm90, then autograd.grad) beside the
direct path of benchmarks/sweep_bwd_sm90.py (its candidate_step: the no-grad forward with its LSE, then
backward.run of the variant the Decision chose), at d=128 and 64, N=16k (16k tokens: batch 16384 / N), 2048/d
heads, bf16, causal and not: wall time per step (median of 20 CUDA-event pairs, no L2 flush) and each path's GPU
kernels (profile_step.kernel_us: mean device time per step over 5 steps). Both paths run the same kernels; this
shows what the autograd glue adds around them (launches, copies, waits).

    python benchmarks/autograd_vs_direct.py [--head-dim 128,64] [--seqlen 16384]
"""
import argparse
import statistics

import torch

import attnforge
from attnforge.bench import measure

from profile_step import kernel_us  # noqa: E402 (run from benchmarks/, which Python puts on the path)
from sweep_bwd_sm90 import candidate_step  # noqa: E402


def paths(d: int, n: int, causal: bool):
    b, h = max(16384 // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    dout, scale = torch.randn_like(q), d ** -0.5
    variant = attnforge.explain(q, k, v, causal=causal, layout="bshd", needs_grad=True, backend="cute_sm90").backward.variant

    def forward(q, k, v):
        return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend="cute_sm90")
    return {"direct": candidate_step(variant, q, k, v, dout, scale),
            "autograd": measure.step(forward, q, k, v, dout, "fwd+bwd")}


def median_ms(fn, repeats: int = 20) -> float:
    """Median wall time of ``fn`` by CUDA events, each call timed alone."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="128,64")
    parser.add_argument("--seqlen", type=int, default=16384)
    args = parser.parse_args()
    for d in map(int, args.head_dim.split(",")):
        for causal in (True, False):
            for name, fn in paths(d, args.seqlen, causal).items():
                print(f"== d={d} causal={causal} {name}: median {median_ms(fn):.3f} ms")
                for kernel, us in kernel_us(fn, 5).items():
                    print(f"   {us / 1000:8.3f} ms  {kernel}")


if __name__ == "__main__":
    main()

"""attnforge's training step through autograd (attention() forced to cute_sm90, then autograd.grad) beside the
direct path of benchmarks/sweep_bwd_sm90.py (its candidate_step: the no-grad forward with its LSE, then
backward.run of the variant the Decision chose), bf16, 16k tokens (batch 16384 / N), 2048/d heads, causal and not:
wall time per step in interleaved rounds (bench.measure.interleaved_ms: do_bench medians with L2 flushed, balanced
orders), every round printed, and each path's GPU kernels (profile_step.kernel_us: mean device time per step over
5 steps), profiled in turns. Both paths run the same kernels; this shows what the autograd glue adds around them
(launches, copies, waits), and how far one round can be from the next.

    python benchmarks/autograd_vs_direct.py [--head-dim 128,64] [--seqlen 16384] [--rounds 6] [--profiles 2]
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
            "autograd": measure.step(forward, q, k, v, dout, "fwd+bwd")}, b, h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="128,64")
    parser.add_argument("--seqlen", default="16384")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profiles", type=int, default=2, help="kernel profiles of each path, in turns")
    args = parser.parse_args()
    for d in map(int, args.head_dim.split(",")):
        for n in map(int, args.seqlen.split(",")):
            for causal in (True, False):
                fns, b, h = paths(d, n, causal)
                flop = attnforge.dispatch.costs.flop_count(b, h, n, n, d, d, causal, "fwd+bwd")
                print(f"== d={d} N={n} {'causal' if causal else 'full'}")
                for name, ms in measure.interleaved_ms(fns, args.rounds).items():
                    median = statistics.median(ms)
                    print(f"   {name:<9} median {median:.3f} ms ({flop / median / 1e9:.1f} TFLOP/s), rounds "
                          + " ".join(f"{x:.3f}" for x in ms))
                for turn in range(args.profiles):
                    for name, fn in fns.items():
                        kernels = ", ".join(f"{kernel[:48]} {us / 1000:.3f}" for kernel, us in kernel_us(fn, 5).items())
                        print(f"   profile {turn} {name}: {kernels} ms")


if __name__ == "__main__":
    main()

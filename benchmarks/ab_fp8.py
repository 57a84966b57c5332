"""FP8 attention forward beside cuDNN's FP8, interleaved: several rounds, each timing every runner once
(triton.testing.do_bench medians, CUDA events), the order rotated each round so that the clock's drift under
the 700 W cap (docs/performance.md, "Power cap") favours none of them. Reports
each runner's median over the rounds and its ratio to cuDNN's per round. Kernel speed, not model speed; FLOPs =
4*B*H*N^2*d, halved when causal; 16k tokens per batch, heads = 2048/d; unit descales.

    python benchmarks/ab_fp8.py [--head-dim 128] [--seqlen 16384] [--rounds 7] [--causal] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

import torch

import attnforge
from attnforge.backends.cute_sm90 import tail_split
from attnforge.backends.cute_sm90.backend import run_kernel
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.bench.measure import flops, interleaved_ms
from attnforge.dispatch import registered
from attnforge.dispatch.mask import CAUSAL, NONE
from attnforge.dispatch.problem import problem_from_tensors

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_fp8 import cudnn_fp8  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    d, n, causal = args.head_dim, args.seqlen, args.causal
    b, h = max(16384 // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    variant, reasons = registered()["cute_sm90"].plan(problem_from_tensors(q, k, v, mask=CAUSAL if causal else NONE))
    if variant is None:
        raise SystemExit(f"cute_sm90 cannot run fp8 d={d}: {'; '.join(reasons)}")
    tile, kernel = variant.tile, variant.kernel
    v_t, descale = prepare_v_fp8(v), torch.ones(3, b, h, device="cuda")
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q.shape[:3], device="cuda")
    scale_log2 = d ** -0.5 * math.log2(math.e)
    runners = {"cute_sm90 fp8 (attention())": lambda: attnforge.attention(q, k, v, causal=causal, backend="cute_sm90"),
               "cute_sm90 fp8 kernel only": lambda: run_kernel(kernel, tile, q, k, v_t, out, lse, scale_log2,
                                                               causal=causal, descale=descale),
               "cuDNN fp8 (e4m3 out)": cudnn_fp8(q, k, v, causal)}
    if tile.tail_split and not causal:
        whole = tail_split.whole(tail_split.counts(tile, b, h, n, n)[0])
        runners["cute_sm90 fp8 kernel, no split"] = lambda: run_kernel(kernel, tile, q, k, v_t, out, lse, scale_log2,
                                                                       causal=causal, descale=descale, plan=whole)
    runners = {name: run for name, run in runners.items() if run is not None}
    names = list(runners)
    times = interleaved_ms(runners, args.rounds)
    work = flops(b, h, n, n, d, d, causal, "fwd")
    peer = "cuDNN fp8 (e4m3 out)"
    rows = []
    for name in names:
        tf = [work / ms / 1e9 for ms in times[name]]
        row = dict(impl=name, head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, tflops_per_round=tf,
                   tflops_median=statistics.median(tf))
        if peer in times:
            row["ratio_to_cudnn_per_round"] = [c / m for m, c in zip(times[name], times[peer])]
        rows.append(row)
        ratios = row.get("ratio_to_cudnn_per_round")
        print(f"d={d} N={n} {'causal' if causal else 'full  '} {name:32s} median {row['tflops_median']:6.0f} TFLOP/s "
              f"(min {min(tf):.0f}, max {max(tf):.0f})" + (f"  vs cuDNN per round: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}" if ratios else ""), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                       "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Wave quantization probe for cute_sm90's non-persistent kernels on the local H100/H200: the picked
kernel's TFLOP/s at shapes whose tile count fills a whole number of waves (tiles = k x SMs) beside
shapes that leave a part-filled last wave. If the last wave costs a whole tile time while most SMs idle,
TFLOP/s falls with the fraction of the last wave left empty. Kernel speed, not model speed; FLOPs =
4*B*H*N^2*d (non-causal), medians of triton.testing.do_bench (CUDA events).

    python benchmarks/wave_probe.py [--kind fp8] [--head-dim 128] [--shapes B:H:N,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib

import torch
import triton.testing

from attnforge.backends.cute_sm90 import variants
from attnforge.backends.cute_sm90 import tail_split
from attnforge.backends.cute_sm90.backend import Sm90Variant, max_ctas, run_kernel
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.bench.measure import flops

# (batch, heads, seqlen). With 192-row tiles on 132 SMs: 16128 = 84 x 192, 84 x 11 = 924 = 7 x 132 and
# 84 x 22 = 14 x 132 tiles (whole waves); 84 x 16 = 1344 (10.18 waves); 16384 x 16 heads (the benchmarks'
# shape) 86 x 16 = 1376 (10.42 waves, one m block of 64 rows per head).
SHAPES = "1:11:16128,1:16:16128,1:22:16128,1:16:16384,1:11:16384,4:16:4096,4:16:4032"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kind", default="fp8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--pieces", default="auto,1", help="plans to time (tail_split tiles): 'auto' (tail_split.plan), "
                   "or pieces per tail tile for the last, part-filled wave (1: every tile whole)")
    p.add_argument("--json")
    args = p.parse_args()
    d, fp8 = args.head_dim, args.kind == "fp8"
    tile, why = variants.pick(args.kind, d)
    if tile is None:
        raise SystemExit(f"cute_sm90 {args.kind} d={d}: {'; '.join(why)}")
    kernel = Sm90Variant(tile, args.kind, d, "fp8" if fp8 else "bf16", False).kernel
    sms = max_ctas(torch.device("cuda"))
    rows = []
    for shape in args.shapes.split(","):
        b, h, n = map(int, shape.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda")
        scale_log2 = d ** -0.5 * math.log2(math.e)
        descale = None
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            v, descale = prepare_v_fp8(v), torch.ones(3, b, h, device="cuda")
        tiles, blocks = tail_split.counts(tile, b, h, n, n)
        plans = [None]  # the kernel's own plan (tail_split: tail_split.plan's), and any forced ones
        if tile.tail_split:
            full = tiles // sms * sms
            plans = [None if x == "auto" else tail_split.Plan(full, tiles - full, int(x)) if int(x) > 1 and full < tiles
                     else tail_split.whole(tiles) for x in args.pieces.split(",")]
            plans = [x for x in plans if x is None or not x.check(tiles, blocks)]
        for plan in plans:
            run = lambda: run_kernel(kernel, tile, q, k, v, out, lse, scale_log2, causal=False,  # noqa: E731
                                     descale=descale, plan=plan)  # noqa: B023
            ran = run()
            ms = triton.testing.do_bench(run, warmup=25, rep=300, return_mode="median")
            row = dict(batch=b, heads=h, seqlen=n, tiles=tiles, waves=tiles / sms, work_waves=n / tile.tile_m * b * h / sms,
                       plan=dataclasses.asdict(ran) if ran else None, ms=ms,
                       tflops=flops(b, h, n, n, d, d, False, "fwd") / ms / 1e9, tile=tile.describe())
            rows.append(row)
            print(f"B={b} H={h:2d} N={n:5d}: {tiles:5d} tiles = {row['waves']:5.2f} waves (work {row['work_waves']:5.2f})"
                  f"  {ms:7.3f} ms  {row['tflops']:6.0f} TFLOP/s  plan {ran}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

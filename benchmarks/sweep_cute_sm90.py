"""Tile sweep for cute_sm90 on the local H100/H200: renders candidate tiles from the template into the
attnforge cache, compiles them in this process, checks each against fp32 math on the same inputs and
times it with CUDA events (triton.testing.do_bench medians). TFLOP/s with FLOPs = 4*B*H*N^2*d (halved
when causal), 16k tokens per batch, heads = 2048/d. The winners go into variants.py by hand, with this run's JSON
committed beside them.

    python benchmarks/sweep_cute_sm90.py [--json out.json] [--head-dim 64,128,256] [--seqlen 4096,16384]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib

import torch
import triton.testing

from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.backend import max_ctas, run_kernel
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.backends.cute_sm90.variants import WG2, WG3, Sm90FwdTile, check
from attnforge.bench.measure import flops
from attnforge.codegen import Source
from attnforge.runtime import cute

CANDIDATES = {
    64: [Sm90FwdTile(128, 128, 2, **WG2), Sm90FwdTile(192, 128, 2, **WG3), Sm90FwdTile(128, 192, 2, **WG2),
         Sm90FwdTile(128, 128, 3, **WG2), Sm90FwdTile(192, 192, 2, **WG3)],
    128: [Sm90FwdTile(128, 128, 2, **WG2), Sm90FwdTile(128, 176, 2, **WG2), Sm90FwdTile(128, 128, 3, **WG2),
          Sm90FwdTile(128, 128, 2, pingpong=False, **WG2), Sm90FwdTile(128, 160, 2, **WG2),
          Sm90FwdTile(192, 64, 2, **WG3)],
    256: [Sm90FwdTile(128, 80, 2, **WG2), Sm90FwdTile(128, 64, 2, **WG2), Sm90FwdTile(128, 96, 2, **WG2)],
}
# The other head dims' ranges (variants.FWD_RANGES), with the TMA-store epilogue they need where padded
_TS = dict(tma_store=True)
CANDIDATES.update({
    48: [Sm90FwdTile(192, 128, 2, **WG3, **_TS), Sm90FwdTile(128, 128, 2, **WG2, **_TS),
         Sm90FwdTile(128, 128, 2, persistent=True, **WG2, **_TS)],
    80: [Sm90FwdTile(128, 128, 2, **WG2, **_TS), Sm90FwdTile(128, 128, 2, persistent=True, **WG2, **_TS),
         Sm90FwdTile(192, 96, 2, **WG3, **_TS), Sm90FwdTile(128, 160, 2, **WG2, **_TS),
         Sm90FwdTile(128, 176, 2, **WG2, **_TS)],
    96: [Sm90FwdTile(128, 128, 2, **WG2, **_TS), Sm90FwdTile(128, 128, 2, persistent=True, **WG2, **_TS),
         Sm90FwdTile(192, 96, 2, **WG3, **_TS), Sm90FwdTile(128, 160, 2, **WG2, **_TS),
         Sm90FwdTile(128, 176, 2, **WG2, **_TS)],
    112: [Sm90FwdTile(128, 128, 2, **WG2, **_TS), Sm90FwdTile(128, 128, 2, persistent=True, **WG2, **_TS)],
    160: [Sm90FwdTile(128, 112, 2, **WG2, **_TS), Sm90FwdTile(128, 96, 2, **WG2, **_TS),
          Sm90FwdTile(128, 128, 2, **WG2, **_TS)],
    192: [Sm90FwdTile(128, 112, 2, **WG2, **_TS), Sm90FwdTile(128, 96, 2, **WG2, **_TS),
          Sm90FwdTile(128, 80, 2, **WG2, **_TS), Sm90FwdTile(128, 64, 2, **WG2, **_TS),
          Sm90FwdTile(128, 112, 2, persistent=True, **WG2, **_TS)],
    224: [Sm90FwdTile(128, 64, 2, **WG2, **_TS), Sm90FwdTile(128, 80, 2, **WG2, **_TS)],
})
FP8_CANDIDATES = {  # FA3 uses 128x224 at d=128 for FP8
    64: [Sm90FwdTile(128, 128, 2, **WG2), Sm90FwdTile(128, 192, 2, **WG2), Sm90FwdTile(192, 128, 2, **WG3)],
    128: [Sm90FwdTile(192, 96, 2, **WG3), Sm90FwdTile(128, 128, 2, **WG2), Sm90FwdTile(128, 160, 2, **WG2),
          Sm90FwdTile(128, 192, 2, **WG2), Sm90FwdTile(128, 128, 3, **WG2),
          Sm90FwdTile(128, 128, 2, pingpong=False, **WG2), Sm90FwdTile(192, 64, 2, **WG3),
          Sm90FwdTile(128, 224, 2, **WG2), Sm90FwdTile(128, 96, 2, **WG2)]
    # without pingpong, as FlashAttention-3 runs FP8
    + [Sm90FwdTile(128, n, 2, pingpong=False, **WG2) for n in (224, 192)]
    + [Sm90FwdTile(192, 96, s, pingpong=p, **WG3) for s, p in ((2, False), (3, True))],
    256: [Sm90FwdTile(128, 64, 2, **WG2), Sm90FwdTile(128, 96, 2, **WG2), Sm90FwdTile(128, 128, 2, **WG2)],
}


def measure(tile, head_dim, args, causals, ctas) -> list[dict]:
    """Render, compile, check and time one tile at every --seqlen; the result rows."""
    fp8 = args.kind == "fp8"
    dtype = "fp8" if fp8 else "bf16"
    invalid = check(tile, head_dim, args.kind)
    if invalid:
        print(f"d={head_dim} {tile.describe()}: invalid: {invalid}")
        return []
    source = Source.of(cc.TEMPLATE, tile.params(head_dim, args.kind), tile.module(head_dim, args.kind))
    kernels = {c: cute.compile_kernel(cc.cute_build(source, dtype, c)) for c in causals}
    rows = []
    for n in map(int, args.seqlen.split(",")):
        b, h = max(16384 // n, 1), 2048 // head_dim
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        if fp8:  # the values the kernel sees, so the fp32 check below uses the same ones
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            extra = (prepare_v_fp8(v), torch.ones(3, b, h, device="cuda"))
        for causal in causals:
            out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(q.shape[:3], device="cuda")
            scale_log2 = head_dim ** -0.5 * math.log2(math.e)
            if fp8:
                run = lambda: run_kernel(kernels[causal], tile, q, k, extra[0], out, lse, scale_log2,  # noqa: E731
                                         causal=causal, descale=extra[1], ctas=ctas)
            else:
                run = lambda: run_kernel(kernels[causal], tile, q, k, v, out, lse, scale_log2,  # noqa: E731
                                         causal=causal, ctas=ctas)
            run()
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), is_causal=causal)
            err = (out[:1, :2].float() - ref).abs().max().item()
            rel = ((out[:1, :2].float() - ref).norm() / ref.norm()).item()  # relative Frobenius; NaN stays NaN
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
            tflops = flops(b, h, n, n, head_dim, head_dim, causal, "fwd") / ms / 1e9
            rows.append(dict(kind=args.kind, head_dim=head_dim, seqlen=n, causal=causal, tile=tile.describe(),
                             module=tile.module(head_dim, args.kind), ms=ms, tflops=tflops, max_err_vs_fp32=err, rel_err_vs_fp32=rel))
            print(f"d={head_dim} N={n} {'causal' if causal else 'full  '} {tile.describe():60s} "
                  f"{tflops:6.0f} TFLOP/s  err {err:.1e} rel {rel:.1e}", flush=True)
    return rows


def variants_of(tile: Sm90FwdTile, spec: str) -> list[Sm90FwdTile]:
    """The tile with each '+'-joined set of fields in ``spec`` set: a name switches a flag on, name=x sets
    a number ('base': as it is)."""
    def value(flag):
        name, _, number = flag.partition("=")
        return name, (int(float(number)) if float(number).is_integer() else float(number)) if number else True
    return [dataclasses.replace(tile, **dict(value(f) for f in flags.split("+") if f != "base"))
            for flags in spec.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--head-dim", default="64,128,256")
    p.add_argument("--seqlen", default="4096,16384")
    p.add_argument("--kind", default="16bit", help="16bit (bf16 inputs) or fp8 (e4m3 inputs, unit descales)")
    p.add_argument("--causal", default="both", choices=("both", "full", "causal"))
    p.add_argument("--match", default="", help="only tiles whose description contains one of these (comma-separated; "
                   "=description: exactly that one)")
    p.add_argument("--variants", default="base", help="each tile as given ('base') and/or with these flags set, "
                   "e.g. 'base,persistent+row_sum_mma,row_sum_mma+rescale_threshold=0.8' (comma-separated; '+' joins)")
    args = p.parse_args()
    results = []
    causals = {"both": (False, True), "full": (False,), "causal": (True,)}[args.causal]
    ctas = max_ctas(torch.device("cuda"))
    for head_dim in map(int, args.head_dim.split(",")):
        for tile in (FP8_CANDIDATES if args.kind == "fp8" else CANDIDATES)[head_dim]:
            if args.match and not any(tile.describe() == m[1:] if m.startswith("=") else m in tile.describe()
                                      for m in args.match.split(",")):
                continue
            for variant in variants_of(tile, args.variants):
                results += measure(variant, head_dim, args, causals, ctas)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                       "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()

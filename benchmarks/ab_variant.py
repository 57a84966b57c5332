"""A/B of cute_sm90 variant flags on the picked tiles, interleaved: each picked tile (variants.picks()) beside the
same tile with some fields changed (e.g. ``--flags tma_store``), on the same inputs, several rounds that each time
every kernel once (triton.testing.do_bench medians, CUDA events) in an order rotated every round, because the
H200's clock drifts under its 700 W cap (docs/performance.md, "Power cap").
Before timing, every output is poisoned with NaN, and each variant's output is compared with the pick's
(and the pick's with fp32 math on two heads). Kernel speed, not model speed; FLOPs = 4*B*H*N^2*d, halved
when causal; 16k tokens per batch, heads = 2048/d; FP8 with unit descales.

    python benchmarks/ab_variant.py --flags tma_store [--kind fp8,16bit] [--head-dim 64,128,256]
        [--seqlen 4096,16384] [--heads H] [--batch B] [--causal both] [--rounds 5] [--json out.json]

``--flags`` takes sets of fields as sweep_cute_sm90.py --variants does: 'persistent+tail_split=0,kv_stages=3'
is two variants (0 switches a flag off). ``--softcap 30`` compiles every kernel with SOFTCAP (16-bit only), e.g.
``--flags exp2_fma_every=2,exp2_fma_every=4 --kind 16bit --softcap 30``; its fp32 reference caps the scores too.

The modules render into the attnforge cache; the kernels compile in parallel worker processes first (one
per variant and mask), each exported to a temporary object file that this process loads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import pathlib
import statistics
import sys
import tempfile

import torch

from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.backend import max_ctas, run_kernel
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.backends.cute_sm90.variants import check, picks
from attnforge.bench.measure import flops, interleaved_ms
from attnforge.codegen import Source
from attnforge.runtime import cute

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from sweep_cute_sm90 import variants_of  # noqa: E402

DTYPE = {"fp8": "fp8", "16bit": "bf16"}
PLAIN = "_plain"  # with --softcap: the pick's module name + this, compiled without SOFTCAP
FIXED = "_fixedmax"  # with --softcap and --fixed-max: a tile's module name + this, compiled with FIXED_MAX


def _compile(build: cute.CuteBuild, obj: str) -> str:
    """Worker: compile one kernel (its module rendered already, at ``build.path``) and export it to ``obj``."""
    cute.export(cute.compile_kernel(build), pathlib.Path(obj))
    return obj


def build(jobs: list[tuple[cute.CuteBuild, str]], workers: int) -> None:
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in concurrent.futures.as_completed([pool.submit(_compile, *job) for job in jobs]):
            future.result()


def inputs(kind: str, b: int, h: int, n: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    if kind == "fp8":  # the values the kernel sees, so the fp32 check uses the same ones
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    return q, k, v


def reference(q, k, v, causal: bool, softcap: float) -> torch.Tensor:
    """fp32 attention, with the scores capped as softcap * tanh(s / softcap) after scaling where softcap > 0."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if causal:  # square here: top-left and bottom-right agree
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flags", required=True, help="variants of each pick, as sweep_cute_sm90.py --variants "
                   "(comma-separated sets of '+'-joined fields), e.g. 'tma_store'")
    p.add_argument("--kind", default="fp8,16bit")
    p.add_argument("--head-dim", default="64,128,256")
    p.add_argument("--seqlen", default="4096,16384")
    p.add_argument("--heads", type=int, help="heads (default 2048 / head_dim)")
    p.add_argument("--batch", type=int, help="batch (default 16384 / seqlen tokens per batch)")
    p.add_argument("--causal", default="both", choices=("both", "full", "causal"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--softcap", type=float, default=0.0, help="compile and run every kernel with this softcap")
    p.add_argument("--fixed-max", action="store_true", help="with --softcap: each tile with FIXED_MAX too (bf16)")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--json")
    args = p.parse_args()
    if args.softcap > 0 and "fp8" in args.kind.split(","):
        p.error("--softcap runs the 16-bit kernels only (--kind 16bit)")
    causals = {"both": (False, True), "full": (False,), "causal": (True,)}[args.causal]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="cute_sm90_ab_"))
    ctas = max_ctas(torch.device("cuda"))

    groups = []  # (kind, d, [tiles]): the pick first
    for kind, d, pick in picks():
        if kind not in args.kind.split(",") or str(d) not in args.head_dim.split(","):
            continue
        tiles = [pick]
        for tile in variants_of(pick, args.flags):
            why = check(tile, d, kind)
            if why:
                print(f"{kind} d={d} {tile.describe()}: skipped: {'; '.join(why)}")
            elif tile != pick:
                tiles.append(tile)
        if len(tiles) > 1 or args.fixed_max:
            groups.append((kind, d, tiles))
    jobs, paths = [], {}
    for kind, d, tiles in groups:
        # with --softcap, the pick without SOFTCAP too (PLAIN): the softcap kernels' cost against the plain kernel
        extra = [(tiles[0], False, False)] if args.softcap > 0 else []
        if args.softcap > 0 and args.fixed_max:  # every tile's FIXED_MAX twin too
            extra += [(t, True, True) for t in tiles]
        for tile, softcap, fixed in [(t, args.softcap > 0, False) for t in tiles] + extra:
            name = tile.module(d, kind) + (FIXED if fixed else "" if softcap or not args.softcap else PLAIN)
            source = Source.of(cc.TEMPLATE, tile.params(d, kind, softcap=softcap, fixed_max=fixed), name)
            for causal in causals:
                paths[name, causal] = str(folder / f"{name}_{int(causal)}.o")
                jobs.append((cc.cute_build(source, DTYPE[kind], causal), paths[name, causal]))  # renders the module
    build(jobs, args.workers)
    kernels = {key: cute.load(pathlib.Path(obj)) for key, obj in paths.items()}

    rows = []
    for kind, d, tiles in groups:
        for n in map(int, args.seqlen.split(",")):
            b, h = args.batch or max(16384 // n, 1), args.heads or 2048 // d
            q, k, v = inputs(kind, b, h, n, d)
            extra = {"descale": torch.ones(3, b, h, device="cuda")} if kind == "fp8" else {}
            v_in = prepare_v_fp8(v) if kind == "fp8" else v
            scale_log2 = d ** -0.5 * math.log2(math.e)
            scores = ()
            if args.softcap > 0:  # the kernel's SOFTCAP arguments (cute_host.score_arguments)
                scores, scale_log2 = (d ** -0.5 / args.softcap,), args.softcap * math.log2(math.e)
            for causal in causals:
                outs, runners = {}, {}

                def add(name, tile, log2_scale, kernel_scores):
                    """A runner of the kernel ``name`` into its own NaN-poisoned output, run once (its output kept)."""
                    out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                    run = (lambda kernel=kernels[name, causal], tile=tile, out=out, lse=lse:
                           run_kernel(kernel, tile, q, k, v_in, out, lse, log2_scale, causal=causal, ctas=ctas,
                                      scores=kernel_scores, **extra))
                    run()
                    outs[name], runners[name] = (out.clone(), lse.clone()), run

                for tile in tiles:
                    add(tile.module(d, kind), tile, scale_log2, scores)
                base = tiles[0].module(d, kind)
                plain = base + PLAIN
                if args.softcap > 0:  # the plain kernel: no SOFTCAP arguments, the plain scale
                    add(plain, tiles[0], d ** -0.5 * math.log2(math.e), ())
                for tile in tiles if args.softcap > 0 and args.fixed_max else ():  # the SOFTCAP kernel's arguments
                    add(tile.module(d, kind) + FIXED, tile, scale_log2, scores)
                ref = reference(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), causal, args.softcap)

                def rel_err(o):  # NaN stays NaN
                    return ((o[:1, :2].float() - ref).norm() / ref.norm()).item()
                rel = rel_err(outs[base][0])
                times = interleaved_ms(runners, args.rounds)
                work = flops(b, h, n, n, d, d, causal, "fwd")
                timed = [(tile, tile.module(d, kind) + suffix) for suffix in ("", FIXED) for tile in tiles
                         if tile.module(d, kind) + suffix in times]
                for tile, name in timed:
                    tf = [work / ms / 1e9 for ms in times[name]]
                    ratios = [t0 / t for t, t0 in zip(times[name], times[base])]
                    to_plain = [t0 / t for t, t0 in zip(times[name], times[plain])] if plain in times else None
                    o, lse = outs[name]
                    row = dict(kind=kind, head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, tile=tile.describe(),
                               module=name, softcap=args.softcap, tflops_per_round=tf,
                               tflops_median=statistics.median(tf), speed_ratio_to_pick_per_round=ratios,
                               speed_ratio_to_plain_per_round=to_plain, pick_rel_err_vs_fp32=rel,
                               rel_err_vs_fp32=rel_err(o), nan_out=bool(o.isnan().any()),
                               nan_lse=bool(lse.isnan().any()),
                               max_abs_diff_to_pick=(o.float() - outs[base][0].float()).abs().max().item(),
                               max_lse_diff_to_pick=(lse - outs[base][1]).abs().max().item())
                    rows.append(row)
                    nan = " NaN!" if row["nan_out"] or row["nan_lse"] else ""
                    label = tile.describe() + (" FIXED_MAX" if name.endswith(FIXED) else "")
                    print(f"{kind} d={d} N={n} {'causal' if causal else 'full  '} {label:75s} "
                          f"{row['tflops_median']:6.0f} TFLOP/s (min {min(tf):.0f}, max {max(tf):.0f})  vs pick: "
                          f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
                          + (f"  vs plain (no softcap) {statistics.median(to_plain):.3f}" if to_plain else "")
                          + f"  diff {row['max_abs_diff_to_pick']:.1e} lse {row['max_lse_diff_to_pick']:.1e}{nan}"
                          f"  (rel err {row['rel_err_vs_fp32']:.1e}, pick {rel:.1e})", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                       "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Tile sweep for triton_fa2 on the local GPU: renders candidate tiles from the templates into the
attnforge cache, checks each against SDPA on the same inputs and times it with CUDA events
(triton.testing.do_bench medians). Forward and backward separately; TFLOP/s with FLOPs =
4*B*H*N^2*d (halved when causal), backward = 2.5x forward. The winners go into variants.py by hand,
with this run's JSON committed beside them.

    python benchmarks/sweep_triton_fa2.py [--json out.json] [--head-dim 64,128] [--seqlen 4096,16384]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.nn.functional as F
import triton.testing

from attnforge.backends.triton_fa2.variants import BwdTile, FwdTile
from attnforge.codegen import Source
from attnforge.runtime import generated

FWD_CANDIDATES = [FwdTile(*a) for a in [
    (128, 64, 8, 2, "descriptor"), (128, 64, 8, 3, "descriptor"), (128, 128, 8, 2, "descriptor"),
    (64, 64, 4, 2, "descriptor"), (64, 64, 4, 3, "descriptor"), (128, 32, 4, 2, "descriptor"),
    (128, 64, 8, 2, "pointer"), (128, 64, 8, 3, "pointer"), (64, 64, 4, 3, "pointer")]]
BWD_CANDIDATES = [BwdTile(*a) for a in [
    (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2),
    (32, 128, 128, 32, 8, 2), (64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3)]]


def load(tile, template):
    """The tile's module, rendered into the attnforge cache and imported."""
    return generated.load(Source.of(template, tile.params(), tile.module))


def rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--head-dim", default="64,128")
    ap.add_argument("--seqlen", default="4096,16384")
    args = ap.parse_args()
    rows = []
    fwd_mods = [(t, load(t, "triton_fa2_fwd.py.jinja")) for t in FWD_CANDIDATES]
    bwd_mods = [(t, load(t, "triton_fa2_bwd.py.jinja")) for t in BWD_CANDIDATES]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in map(int, args.head_dim.split(",")):
        for n in map(int, args.seqlen.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                               for _ in range(4))
                scale = d ** -0.5
                fl = 4 * b * h * n * n * d / (2 if causal else 1)
                qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
                ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale)
                ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do)
                ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                                             return_mode="median")
                rows.append(dict(kind="fwd", tile="sdpa (torch's pick)", d=d, n=n, causal=causal, ms=ms, tflops=fl / ms / 1e9))
                lse_for_bwd = out_for_bwd = None
                for tile, mod in fwd_mods:
                    out = torch.full_like(q, float("nan"))
                    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
                    try:
                        mod.launch(q, k, v, out, lse, causal=causal, scale=scale)
                        err = rel(out, ref)
                        ms = triton.testing.do_bench(lambda: mod.launch(q, k, v, out, lse, causal=causal, scale=scale),
                                                     return_mode="median")
                        rows.append(dict(kind="fwd", tile=tile.describe(), d=d, n=n, causal=causal, ms=ms,
                                         tflops=fl / ms / 1e9, err=err))
                        if out_for_bwd is None and err < 1e-2:
                            out_for_bwd, lse_for_bwd = out.clone(), lse.clone()
                    except Exception as exc:
                        rows.append(dict(kind="fwd", tile=tile.describe(), d=d, n=n, causal=causal, error=str(exc)[:200]))
                    print(rows[-1], flush=True)
                for tile, mod in bwd_mods:
                    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                    try:
                        mod.launch(q, k, v, out_for_bwd, lse_for_bwd, do, dq, dk, dv, causal=causal, scale=scale)
                        err = max(rel(g, r) for g, r in zip((dq, dk, dv), ref_grads))
                        ms = triton.testing.do_bench(lambda: mod.launch(q, k, v, out_for_bwd, lse_for_bwd, do, dq, dk, dv,
                                                                        causal=causal, scale=scale), return_mode="median")
                        rows.append(dict(kind="bwd", tile=tile.describe(), d=d, n=n, causal=causal, ms=ms,
                                         tflops=2.5 * fl / ms / 1e9, err=err))
                    except Exception as exc:
                        rows.append(dict(kind="bwd", tile=tile.describe(), d=d, n=n, causal=causal, error=str(exc)[:200]))
                    print(rows[-1], flush=True)
    print("\nbest per (kind, d, n, causal):")
    for key in sorted({(r["kind"], r["d"], r["n"], r["causal"]) for r in rows}):
        ok = [r for r in rows if (r["kind"], r["d"], r["n"], r["causal"]) == key and "tflops" in r and r.get("err", 0) < 2e-2]
        ok.sort(key=lambda r: -r["tflops"])
        print(key, [(r["tile"], round(r["tflops"])) for r in ok[:4]])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

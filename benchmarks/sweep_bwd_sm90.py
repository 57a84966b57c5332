"""Backward tile sweep for cute_sm90 on the local H100/H200, forward+backward: cute_sm90's forward
(attention(return_lse=True), forced) followed by each candidate backward kernel (backward.run), beside attnforge's
own training step (autograd; the table's tile), cuDNN's SDPA and FlashAttention-4, on the same fresh random inputs
(bf16, (batch, seqlen, heads, head_dim) memory order), timed in interleaved rounds (bench.measure.interleaved_ms:
triton.testing.do_bench medians, CUDA events, order rotated each round). Kernel speed, not model speed. FLOPs: 3.5x
the forward's 4 * batch * heads * N^2 * d, halved causal (dispatch.costs.flop_count). Every candidate's gradients
are first checked against fp64 math (testing.assert_close, the GPU tests' bound) on a small odd GQA shape, each in a
process of its own; a candidate that fails (or faults) is reported and not timed. Each tile is timed as it is and
in its deterministic=True form (dQ added in key-block order): the cost of reproducibility. The winners go into
bwd_variants.py by hand, with this run's JSON committed beside them.

    python benchmarks/sweep_bwd_sm90.py [--head-dim 64,128] [--seqlen 16384] [--tokens 16384] [--rounds 3]
        [--jobs 8] [--twin stats_ahead] [--no-deterministic] [--json out.json]

--twin FIELD[+FIELD...] adds, beside each table tile, its twin with those boolean Sm90BwdTile fields turned on, or
FIELD=N set (tile_m=80+dq_transposed: FlashAttention-3's 80-row block at d=128); an A/B of template options in the
same rounds; a twin the table's check refuses is left out; --no-deterministic leaves out the deterministic forms.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import statistics

import torch

import attnforge
from attnforge.backends.cute_sm90 import backward
from attnforge.backends.cute_sm90.bwd_variants import BWD, check, kernel_head_dim, mask_reasons
from attnforge.bench import impls, measure
from attnforge.dispatch import costs
from attnforge.runtime import cute
from attnforge.testing import assert_close, oracle, peer_error

# The table's tiles by kernel head dim (a head dim runs the kernel of kernel_head_dim(d)); add candidates beside
# them. (The issue orders of the consumer step and the dQ warp were
# compared this way: benchmarks/results/2026-12-01-h200-cute_sm90-bwd-order/.)
CANDIDATES = {d: list(tiles) for d, tiles in BWD.items()}


def twins(tiles, options: list[str], head_dim: int) -> list:
    """Each of ``tiles`` with the fields of each option ("field+field", a boolean field turned on, or "field=int" set)
    changed, where that changes the tile and the table's check accepts it at ``head_dim``."""
    out = []
    for fields in options:
        changes = {f.split("=")[0]: int(f.split("=")[1]) if "=" in f else True for f in fields.split("+")}
        for tile in tiles:
            twin = dataclasses.replace(tile, **changes)
            if twin != tile and not check(twin, head_dim):
                out.append(twin)
    return out


def label(variant) -> str:
    return f"bwd {variant.tile.describe()}" + (" deterministic" if variant.deterministic else "")


def _build(build) -> str:
    return str(cute.build_cached(build)[0])


def prebuild(variants, jobs: int) -> None:
    """Every candidate's kernel into the cache, ``jobs`` at once (each worker imports the CuTe DSL once)."""
    builds = [v.build for v in variants]
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(builds)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for path in pool.map(_build, builds):
            print("built", path, flush=True)


def _checked(job) -> str | None:
    variant, seed = job
    try:
        return correct(variant, torch.Generator().manual_seed(seed))
    except Exception as e:  # noqa: BLE001  (a kernel fault: this candidate's result, not the sweep's end)
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def check_all(variants, jobs: int) -> dict[str, str | None]:
    """Each candidate's gradient check (correct) in a process of its own, ``jobs`` at once: a kernel that faults
    breaks its process's CUDA context, not the sweep's, and is reported as failed."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(variants)), mp_context=context,
                                                max_tasks_per_child=1) as pool:
        futures = [pool.submit(_checked, (v, seed)) for seed, v in enumerate(variants)]
        out = {}
        for v, future in zip(variants, futures):
            try:
                out[v.name] = future.result()
            except concurrent.futures.process.BrokenProcessPool as e:  # a process that died outright
                out[v.name] = f"its check's process died ({e})"
            print(v.name, "gradients:", out[v.name] or "ok", flush=True)
    return out


def correct(variant, gen) -> str | None:
    """None when ``variant``'s gradients match fp64 math on a (1, 4, 2, 333, 555) GQA shape, else the error."""
    b, hq, hkv, nq, nk, d = 1, 4, 2, 333, 555, variant.head_dim
    q = torch.randn(b, hq, nq, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(b, hkv, nk, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    dout = torch.randn(b, hq, nq, d, generator=gen).to("cuda", torch.bfloat16)
    ref_out, ref_lse, ref_grads = oracle(q, k, v, causal=variant.causal, dout=dout)
    _, peer_grads = peer_error(q, k, v, causal=variant.causal, dout=dout)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    grads = backward.run(variant, q, k, v, ref_out.to(torch.bfloat16), ref_lse.float(), dout, d ** -0.5, dk=dk, dv=dv)
    try:
        for name, x, ref, peer in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
            assert_close(name, x, ref, peer, ulps=8 * math.sqrt(max(nq, nk, d)))
    except AssertionError as e:
        return str(e)
    return None


def candidate_step(variant, q, k, v, dout, scale):
    """Forward+backward of the candidate: the forced cute_sm90 forward with its LSE, then the kernel itself."""
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def run():
        with torch.no_grad():
            out, lse = attnforge.attention(q, k, v, causal=variant.causal, scale=scale, layout="bshd",
                                           return_lse=True, backend="cute_sm90")
        return backward.run(variant, qt, kt, vt, out.transpose(1, 2), lse, dt, scale)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="64,128")
    parser.add_argument("--seqlen", default="16384")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--twin", action="append", default=[], help="boolean Sm90BwdTile fields, joined by +")
    parser.add_argument("--no-deterministic", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dims = [int(d) for d in args.head_dim.split(",")]
    forms = (False,) if args.no_deterministic else (False, True)
    tiles = {d: [*tiles, *twins(tiles, args.twin, d)] for d, tiles in CANDIDATES.items()}
    variants = {(d, causal): [backward.Sm90BwdVariant(t, d, "bf16", causal, det)
                              for t in tiles[kernel_head_dim(d)] if not mask_reasons(t, causal)
                              for det in forms]
                for d in dims for causal in (False, True)}
    for (d, _), vs in variants.items():
        for v in vs:
            assert not check(v.tile, d), (v.tile, check(v.tile, d))
    prebuild([v for vs in variants.values() for v in vs], args.jobs)
    failed = check_all([v for vs in variants.values() for v in vs], args.jobs)
    cuda_gen = torch.Generator(device="cuda").manual_seed(0)
    table, results = impls.implementations(), []
    peers = []  # the peers that can run here; the others are left out with why
    for peer in ("sdpa-cudnn", "fa4"):
        why = table[peer].why_not(torch.device("cuda"), torch.bfloat16)
        if why:
            print(f"{peer} not run: {why}", flush=True)
        else:
            peers.append(peer)
    for d in dims:
        for n in map(int, args.seqlen.split(",")):
            for causal in (False, True):
                b, h = max(args.tokens // n, 1), 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=cuda_gen).to(torch.bfloat16)
                           for _ in range(3))
                dout = torch.randn_like(q)
                scale = d ** -0.5

                def attnforge_step(q, k, v):
                    return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend="cute_sm90")

                runners = {label(var): candidate_step(var, q, k, v, dout, scale)
                           for var in variants[d, causal] if failed[var.name] is None}
                if attnforge.explain(q, k, v, causal=causal, layout="bshd", needs_grad=True, backend="cute_sm90").ok:
                    runners["attnforge (table)"] = measure.step(attnforge_step, q, k, v, dout, "fwd+bwd")
                for peer in peers:
                    runners[peer] = measure.step(table[peer].make(causal, scale), q, k, v, dout, "fwd+bwd")
                times = measure.interleaved_ms(runners, args.rounds)
                flop = costs.flop_count(b, h, n, n, d, d, causal, "fwd+bwd")
                row = {"head_dim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal,
                       "ms": {name: statistics.median(t) for name, t in times.items()},
                       "round_ms": times}  # every round: at a power cap one round can sit 6-14% off the others
                row["tflops"] = {name: round(flop / (ms * 1e-3) / 1e12, 1) for name, ms in row["ms"].items()}
                results.append(row)
                print(json.dumps({k: row[k] for k in ("head_dim", "seqlen", "causal", "tflops")}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": measure.environment(torch.device("cuda")), "flops": measure.FLOP_FORMULA, "timing": measure.TIMING,
                       "candidates": {v.name: (failed[v.name] or "ok") for vs in variants.values() for v in vs},
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

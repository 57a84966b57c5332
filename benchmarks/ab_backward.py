"""Same-run A/B of the sm90 backwards, forward+backward: cute_sm90's forward followed by its own backward or by
triton_fa2's, beside cuDNN's SDPA and FlashAttention-4, on the same fresh random inputs (bf16, (batch, seqlen,
heads, head_dim) memory order), timed in interleaved rounds (bench.measure.interleaved_ms: triton.testing.do_bench
medians, CUDA events, order rotated each round). Kernel speed, not model speed. FLOPs: 3.5x the forward's
4 * batch * heads * N^2 * d, halved causal (dispatch.costs.flop_count).

    python benchmarks/ab_backward.py [--head-dim 64,128] [--seqlen 16384] [--tokens 16384] [--rounds 3]
        [--kv-heads H] [--json out.json]

The triton_fa2 pairing runs attnforge forced by use_backend("cute_sm90") with cute_sm90's backward set aside
while its Decision is made (that Decision stays cached for the call signature); the other by backend=.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import attnforge
from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.bench import impls, measure
from attnforge.dispatch import costs, select


def runners(causal: bool, scale: float, q, k, v, dout):
    """name -> timed callable; the attnforge pairings' Decisions are checked to be the ones named."""
    def forced_arg(q, k, v):
        return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend="cute_sm90")

    def forced_ctx(q, k, v):
        with attnforge.use_backend("cute_sm90"):
            return attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd")

    saved = dict(bwd_variants.BWD)
    bwd_variants.BWD.clear()  # cute_sm90 has no backward while forced_ctx's Decision is made
    select.decide.cache_clear()
    try:
        with attnforge.use_backend("cute_sm90"):
            triton_decision = attnforge.explain(q, k, v, causal=causal, needs_grad=True, layout="bshd")
        measure.step(forced_ctx, q, k, v, dout, "fwd+bwd")()
    finally:
        bwd_variants.BWD.update(saved)
        select.decide.cache_clear()
    cute_decision = attnforge.explain(q, k, v, causal=causal, needs_grad=True, layout="bshd", backend="cute_sm90")
    assert triton_decision.backward.backend == "triton_fa2", triton_decision
    assert cute_decision.backward.backend == "cute_sm90", cute_decision
    table = impls.implementations()
    return {"cute_sm90+cute_sm90": measure.step(forced_arg, q, k, v, dout, "fwd+bwd"),
            "cute_sm90+triton_fa2": measure.step(forced_ctx, q, k, v, dout, "fwd+bwd"),
            "sdpa-cudnn": measure.step(table["sdpa-cudnn"].make(causal, scale), q, k, v, dout, "fwd+bwd"),
            "fa4": measure.step(table["fa4"].make(causal, scale), q, k, v, dout, "fwd+bwd")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", default="64,128")
    parser.add_argument("--seqlen", default="16384")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for d in map(int, args.head_dim.split(",")):
        for n in map(int, args.seqlen.split(",")):
            for causal in (False, True):
                b, h = max(args.tokens // n, 1), 2048 // d
                hkv = args.kv_heads or h
                q = torch.randn(b, n, h, d, device="cuda", generator=gen).to(torch.bfloat16)
                k, v = (torch.randn(b, n, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
                dout = torch.randn_like(q)
                times = measure.interleaved_ms(runners(causal, d ** -0.5, q, k, v, dout), args.rounds)
                flop = costs.flop_count(b, h, n, n, d, d, causal, "fwd+bwd")
                row = {"head_dim": d, "seqlen": n, "batch": b, "heads": h, "kv_heads": hkv, "causal": causal,
                       "ms": {name: statistics.median(t) for name, t in times.items()}}
                row["tflops"] = {name: round(flop / (ms * 1e-3) / 1e12, 1) for name, ms in row["ms"].items()}
                results.append(row)
                print(f"d={d} N={n} b={b} h={h}/{hkv} {'causal' if causal else 'full'}: "
                      + ", ".join(f"{name} {tf}" for name, tf in row["tflops"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Does attnforge's automatic choice match the fastest plan it has? On realistic model shapes (GQA prefill, odd
lengths, head dims 80/96, many short sequences, cross-attention, decode, one long sequence, d=256) and the
standard grid (d 64/128/256 x N 1k/4k/16k x full/causal, 16k tokens per call, heads 2048/d), forward
and forward+backward: attnforge auto, every backend forced, and stock ``F.scaled_dot_product_attention``
(torch's default choice), on the same inputs, in interleaved rounds per row (bench.measure.interleaved_ms: CUDA-event
medians, the median over the rounds; kernel speed). TFLOP/s by dispatch.costs.flops. Prints auto's ratio to the fastest
and the evidence its Decision chose by.

    python benchmarks/dispatch_check.py [--set models|grid|all] [--only LABEL-TEXT] [--rounds N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import attnforge
from attnforge.bench import measure
from attnforge.dispatch import costs

# (label, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, modes)
SHAPES = [
    ("GQA 32/8 prefill 8k causal", 2, 32, 8, 8192, 8192, 128, True, ("fwd", "fwd+bwd")),
    ("odd length 1023 causal", 8, 16, 16, 1023, 1023, 128, True, ("fwd", "fwd+bwd")),
    ("head dim 80, 4k", 4, 32, 32, 4096, 4096, 80, False, ("fwd", "fwd+bwd")),
    ("head dim 96, 4k", 4, 24, 24, 4096, 4096, 96, False, ("fwd", "fwd+bwd")),
    ("head dim 192, 4k causal", 4, 16, 16, 4096, 4096, 192, True, ("fwd", "fwd+bwd")),
    ("32 x 512 causal, d=64", 32, 32, 32, 512, 512, 64, True, ("fwd", "fwd+bwd")),
    ("cross-attention 256 x 8k", 8, 16, 4, 256, 8192, 128, False, ("fwd", "fwd+bwd")),
    ("decode 1 x 8k, batch 64, GQA 32/8", 64, 32, 8, 1, 8192, 128, False, ("fwd",)),
    ("long 64k causal, GQA 16/4", 1, 16, 4, 65536, 65536, 128, True, ("fwd", "fwd+bwd")),
    ("d=256 causal 8k", 2, 8, 8, 8192, 8192, 256, True, ("fwd", "fwd+bwd")),
]
# The standard grid (the benchmarks' and docs/performance.md's): 16k tokens per call, heads 2048/d
GRID = [(f"grid d={d} N={n}{' causal' if causal else ''}", 16384 // n, 2048 // d, 2048 // d, n, n, d, causal,
         ("fwd", "fwd+bwd")) for d in (64, 128, 256) for n in (1024, 4096, 16384) for causal in (False, True)]
SETS = {"models": SHAPES, "grid": GRID, "all": SHAPES + GRID}
BACKENDS = ("cute_sm90", "triton_fa2", "sdpa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--set", default="all", choices=tuple(SETS), help="the model shapes, the standard grid "
                        "(d 64/128/256 x N 1k/4k/16k x full/causal, 16k tokens, heads 2048/d), or both (default)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per row (default: the "
                        "whole balanced design, 10 rounds for five plans: each follows every other twice)")
    parser.add_argument("--only", default=None, help="only the rows whose label contains this text")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    environment = measure.environment(torch.device("cuda"))
    rows = []
    for label, b, hq, hkv, nq, nk, d, causal, modes in SETS[args.set]:
        if args.only and args.only not in label:
            continue
        def rand(h, n):
            return torch.randn(b, h, n, d, device="cuda", generator=gen).bfloat16()
        q, k, v = rand(hq, nq), rand(hkv, nk), rand(hkv, nk)
        dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        for mode in modes:
            decision = attnforge.explain(q, k, v, causal=causal, needs_grad=mode == "fwd+bwd")
            impls = {"auto": lambda q, k, v: attnforge.attention(q, k, v, causal=causal)}
            for name in BACKENDS:
                if attnforge.explain(q, k, v, causal=causal, needs_grad=mode == "fwd+bwd", backend=name).ok:
                    impls[name] = lambda q, k, v, name=name: attnforge.attention(q, k, v, causal=causal, backend=name)
            if not causal or nq == nk:  # SDPA's is_causal is top-left: the same mask only when square
                impls["torch SDPA"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                      enable_gqa=hq != hkv)
            flop = costs.flops(decision.problem, mode)
            # interleaved rounds (measure.balanced_orders, after an untimed pass), medians: timed one after another
            # once each, the same plan measured up to 12% apart (the H200's clock drifts at its power cap). Each keeps
            # the 25 ms warm-up: with 10 ms (and 50 ms of repetitions) the sdpa backend, then always timed right after
            # triton_fa2, measured up to 9% above the same SDPA call by stock torch (dispatch_check-2.json in
            # benchmarks/results/2026-12-02-h200-dispatch/; 25 ms and one 150 ms block: within 3%)
            rounds = measure.round_count(len(impls), args.rounds)
            times = measure.interleaved_ms({name: measure.step(fn, q, k, v, dout, mode) for name, fn in impls.items()},
                                           rounds, warmup_ms=25, rep_ms=150 / rounds)
            tflops = {name: flop / (statistics.median(ms) * 1e-3) / 1e12 for name, ms in times.items()}
            best = max((n for n in tflops if n != "auto"), key=tflops.get)
            row = {"shape": label, "mode": mode, "tflops": {n: round(t, 1) for n, t in tflops.items()},
                   "fastest": best, "auto_vs_fastest": round(tflops["auto"] / tflops[best], 3),
                   # each runner's median per round, in the order the rounds ran (measure.balanced_orders)
                   "ms_by_round": {n: [round(t, 4) for t in ms] for n, ms in times.items()},
                   "auto_chose": [decision.forward.backend, decision.backward.backend if decision.backward else None],
                   "note": decision.forward.note,
                   "evidence": {c.backend: c.evidence for c in decision.forward.candidates if c.evidence}}
            rows.append(row)
            print(f"{label:36s} {mode:8s} auto={tflops['auto']:6.1f} ({'+'.join(filter(None, row['auto_chose']))}) "
                  + " ".join(f"{n}={t:.1f}" for n, t in tflops.items() if n != "auto")
                  + f"  auto/fastest={row['auto_vs_fastest']:.3f}  [{row['note']}]", flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"environment": environment, "rows": rows}, f, indent=1)
    worst = min(rows, key=lambda r: r["auto_vs_fastest"])
    print(f"worst auto/fastest: {worst['auto_vs_fastest']} ({worst['shape']}, {worst['mode']})")


if __name__ == "__main__":
    main()

"""Wall time per call on a tiny problem (B=1, H=8, N=128, d=64, bf16), where the kernel itself is a few
microseconds and the rest is the launch path: attnforge.attention() (automatic choice), the cute_sm90
compiled kernel called directly, torch SDPA and FlashAttention-4 when installed. Calls are queued
back to back and the queue drained once per repeat, the implementations taking turns (round-robin);
median per-call time over repeats. The kernel
time alone is do_bench's CUDA-event median.

    python benchmarks/launch_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton.testing

import attnforge
from attnforge.bench.measure import wall_us_per_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    impls = {"attnforge.attention (auto)": lambda: attnforge.attention(q, k, v),
             "attnforge.attention, cute_sm90": lambda: attnforge.attention(q, k, v, backend="cute_sm90"),
             "attnforge.attention, triton_fa2": lambda: attnforge.attention(q, k, v, backend="triton_fa2"),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    decision = attnforge.explain(q, k, v)
    if torch.cuda.get_device_capability() == (9, 0):
        from attnforge.backends.cute_sm90.backend import run_kernel
        from attnforge.dispatch import registered
        from attnforge.dispatch.call import Call
        from attnforge.dispatch.mask import NONE
        from attnforge.dispatch.problem import problem_from_tensors

        backend = registered()["cute_sm90"]
        variant, reasons = backend.plan(problem_from_tensors(q, k, v))
        if variant is None:
            raise SystemExit(f"cute_sm90 cannot run {q.dtype} d=64: {'; '.join(reasons)}")
        kernel, tile = variant.kernel, variant.tile
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        scale_log2 = 64 ** -0.5 * math.log2(math.e)
        # through run_kernel, which passes each kernel the arguments its signature takes (and plans a tail split)
        impls["cute_sm90 kernel, called directly"] = lambda: run_kernel(kernel, tile, q, k, v, out, lse, scale_log2,
                                                                        causal=False)
        # where the rest goes: the backend's forward() without the dispatcher, the dispatcher alone
        # (a cached Decision lookup) and the two output allocations
        impls["cute_sm90 forward(), no dispatch"] = lambda: backend.forward(variant, Call(q, k, v, 0.125, NONE))
        from attnforge.dispatch.select import decide_call

        impls["dispatch only (decide_call)"] = lambda: decide_call(q, k, v, "bhsd", NONE, 0.0, False, None)
        impls["two torch.empty (out, lse)"] = lambda: (torch.empty_like(q), torch.empty(q.shape[:3], device="cuda"))
        impls["torch.empty(shape, dtype, device)"] = lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device)
    try:
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        impls["FlashAttention-4"] = lambda: flash_attn_func(qt, kt, vt)
    except ImportError:
        pass
    rows = []
    walls = wall_us_per_call(impls, calls=200, repeats=15, sync=torch.cuda.synchronize)
    for name, fn in impls.items():
        wall = walls[name]
        kernel_us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        rows.append(dict(impl=name, wall_us_per_call=wall, do_bench_us=kernel_us))
        print(f"{name:36s} wall {wall:7.1f} us/call   do_bench {kernel_us:7.1f} us", flush=True)
    print("chosen:", decision.forward.backend, decision.forward.describe())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [1, 8, 128, 64], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

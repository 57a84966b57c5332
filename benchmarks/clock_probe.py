"""SM clock and power while an attention forward runs back to back on the local GPU: is a kernel held
back by the clock (power or thermal limits) rather than by its own schedule? For each runner: ~N
seconds of calls, nvidia-smi sampling clocks.sm, power.draw and the active clock-event reasons every
50 ms, CUDA events around the whole loop for TFLOP/s (FLOPs = 4*B*H*N^2*d, halved when causal; 16k
tokens, heads = 2048/d). Runners: cute_sm90 FP8 and bf16 (kernels alone), cuDNN FP8 (nvidia-cudnn-frontend,
when importable) and cuDNN bf16 through SDPA.

    python benchmarks/clock_probe.py [--seconds 3] [--head-dim 128] [--seqlen 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from attnforge.backends.cute_sm90.backend import max_ctas, run_kernel
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.bench.measure import flops
from attnforge.dispatch import registered
from attnforge.dispatch.mask import CAUSAL, NONE
from attnforge.dispatch.problem import problem_from_tensors

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_fp8 import cudnn_fp8  # noqa: E402

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sample_while(run, seconds: float) -> dict:
    """Call ``run`` back to back for ``seconds`` with nvidia-smi sampling; ms per call and the samples."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(50):
            run()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    lines = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    if len(lines) < 4:
        raise RuntimeError(f"nvidia-smi gave {len(lines)} samples for --query-gpu={QUERY}")
    clocks = [float(c) for c, _, _ in lines[2:-1]]  # drop the edges (idle before, teardown after)
    power = [float(p) for _, p, _ in lines[2:-1]]
    reasons = sorted({r for _, _, r in lines[2:-1]})
    return dict(ms=start.elapsed_time(end) / calls, calls=calls, clock_mhz_median=statistics.median(clocks),
                clock_mhz_min=min(clocks), power_w_median=statistics.median(power), event_reasons=reasons)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--json")
    args = p.parse_args()
    d, n = args.head_dim, args.seqlen
    b, h = max(16384 // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    backend = registered()["cute_sm90"]
    scale_log2 = d ** -0.5 * math.log2(math.e)
    lse = torch.empty(q.shape[:3], device="cuda")
    out = torch.empty_like(q)
    ctas = max_ctas(q.device)
    results = []
    for causal in (False, True):
        mask = CAUSAL if causal else NONE
        picked = []  # the fp8 and bf16 variants attention() plans for these inputs
        for inputs in ((q8, k8, v8), (q, k, v)):
            variant, reasons = backend.plan(problem_from_tensors(*inputs, mask=mask))
            if variant is None:
                raise SystemExit(f"cute_sm90 cannot run {inputs[0].dtype} d={d}: {'; '.join(reasons)}")
            picked.append(variant)
        fp8, bf16 = (x.kernel for x in picked)
        vt, descale = prepare_v_fp8(v8), torch.ones(3, b, h, device="cuda")
        tiles = tuple(x.tile for x in picked)
        runners = {"cute_sm90 fp8 (kernel)": lambda: run_kernel(  # noqa: B023
                       fp8, tiles[0], q8, k8, vt, out, lse, scale_log2, causal=causal, descale=descale, ctas=ctas),  # noqa: B023
                   "cute_sm90 bf16 (kernel)": lambda: run_kernel(  # noqa: B023
                       bf16, tiles[1], q, k, v, out, lse, scale_log2, causal=causal, ctas=ctas),  # noqa: B023
                   "cudnn fp8": cudnn_fp8(q8, k8, v8, causal)}
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            runners["cudnn bf16 (sdpa)"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: B023
            for name, run in runners.items():
                if run is None:
                    print(f"{name}: not available here")
                    continue
                r = sample_while(run, args.seconds)
                r.update(name=name, causal=causal, head_dim=d, seqlen=n,
                         tflops=flops(b, h, n, n, d, d, causal, "fwd") / r["ms"] / 1e9)
                results.append(r)
                print(f"{name:26s} {'causal' if causal else 'full  '} {r['tflops']:6.0f} TFLOP/s  clock median "
                      f"{r['clock_mhz_median']:.0f} MHz (min {r['clock_mhz_min']:.0f})  power {r['power_w_median']:.0f} W  "
                      f"reasons {r['event_reasons']}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""FP8 (e4m3) attention forward on the local H100/H200, side by side: attnforge's cute_sm90 FP8 (bf16
out; through attention(), so V's transpose + key permutation is included, and the kernel alone),
cuDNN's FP8 SDPA through nvidia-cudnn-frontend (e4m3 out: cuDNN refuses bf16 output for FP8 on
Hopper), and cute_sm90 in bf16 on the same (dequantised) values. Medians of triton.testing.do_bench
(CUDA events); TFLOP/s with FLOPs = 4*B*H*N^2*d, halved when causal; 16k tokens per batch, heads =
2048/d. Errors: relative Frobenius against fp32 math on the dequantised inputs (unit descales: the
inputs are N(0,1) rounded to e4m3).

    python benchmarks/bench_fp8.py [--json out.json] [--head-dim 64,128,256] [--seqlen 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton.testing

import attnforge
from attnforge.backends.cute_sm90 import tail_split
from attnforge.backends.cute_sm90.backend import run_kernel
from attnforge.backends.cute_sm90 import v_layout
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.bench.measure import flops
from attnforge.dispatch import registered
from attnforge.dispatch.mask import CAUSAL, NONE
from attnforge.dispatch.problem import problem_from_tensors
from attnforge.testing import rel_error


def cudnn_fp8(q, k, v, causal):
    """A runner for cuDNN's FP8 SDPA forward (unit scales) on (b, h, s, d) e4m3 tensors, or None."""
    try:
        import cudnn
    except ImportError:
        return None
    e4m3 = cudnn.data_type.FP8_E4M3
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tq, tk, tv = (graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
                  for n, t in (("Q", q), ("K", k), ("V", v)))
    ones = torch.ones(1, 1, 1, 1, device="cuda")
    scales = [graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT) for _ in range(6)]
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scales[0], descale_k=scales[1],
                                          descale_v=scales[2], descale_s=scales[3], scale_s=scales[4],
                                          scale_o=scales[5], is_inference=True,
                                          attn_scale=1.0 / math.sqrt(q.shape[-1]), use_causal_mask=causal)
    out = torch.empty_like(q)
    amax = [torch.empty(1, 1, 1, 1, device="cuda") for _ in range(2)]
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
    for t, buf in zip((amax_s, amax_o), amax):
        t.set_output(False).set_dim(list(buf.shape)).set_stride(list(buf.stride()))
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    pack = {tq: q, tk: k, tv: v, o: out, amax_s: amax[0], amax_o: amax[1], **{s: ones for s in scales}}
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)

    def run():
        graph.execute(pack, workspace)
        return out
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--head-dim", default="64,128,256")
    p.add_argument("--seqlen", default="1024,4096,16384")
    args = p.parse_args()
    rows = []
    for head_dim in map(int, args.head_dim.split(",")):
        for n in map(int, args.seqlen.split(",")):
            b, h = max(16384 // n, 1), 2048 // head_dim
            g = torch.Generator(device="cuda").manual_seed(0)
            q8, k8, v8 = (torch.randn(b, h, n, head_dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
                          for _ in range(3))
            qb, kb, vb = (t.to(torch.bfloat16) for t in (q8, k8, v8))
            for causal in (False, True):
                work = flops(b, h, n, n, head_dim, head_dim, causal, "fwd")
                ref = F.scaled_dot_product_attention(qb[:1, :4].float(), kb[:1, :4].float(), vb[:1, :4].float(),
                                                     is_causal=causal)
                impls = {"cute_sm90 fp8 (attention())":  # forced: the automatic choice may route bf16 elsewhere
                         lambda: attnforge.attention(q8, k8, v8, causal=causal, backend="cute_sm90"),
                         "cute_sm90 bf16 (attention())":
                         lambda: attnforge.attention(qb, kb, vb, causal=causal, backend="cute_sm90")}
                variant, reasons = registered()["cute_sm90"].plan(
                    problem_from_tensors(q8, k8, v8, mask=CAUSAL if causal else NONE))
                if variant is None:
                    raise SystemExit(f"cute_sm90 cannot run fp8 d={head_dim}: {'; '.join(reasons)}")
                kernel, tile = variant.kernel, variant.tile
                v_t = prepare_v_fp8(v8)
                out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(q8.shape[:3], device="cuda")
                descale = torch.ones(3, b, h, device="cuda")
                scale_log2 = head_dim ** -0.5 * math.log2(math.e)
                # the kernel (with a tail split, its pieces' combine too: part of its work), no V^T
                impls["cute_sm90 fp8 kernel only"] = lambda: (run_kernel(
                    kernel, tile, q8, k8, v_t, out, lse, scale_log2, causal=causal, descale=descale), out)[1]
                if tile.tail_split and not causal:  # the same kernel with every tile whole: the split's A/B
                    whole = tail_split.whole(tail_split.counts(tile, b, h, n, n)[0])
                    impls["cute_sm90 fp8 kernel, no split"] = lambda: (run_kernel(
                        kernel, tile, q8, k8, v_t, out, lse, scale_log2, causal=causal, descale=descale,
                        plan=whole), out)[1]
                if not causal:  # V's layout does not depend on the mask: timed once per shape
                    impls["V^T key permutation alone"] = lambda: prepare_v_fp8(v8)
                    impls["V^T, torch strided copy"] = lambda: v_layout.prepare_v_fp8_torch(v8)
                try:
                    runner = cudnn_fp8(q8, k8, v8, causal)
                except Exception as e:  # cuDNN refuses some shapes; say so
                    runner = None
                    print(f"cuDNN FP8 d={head_dim} N={n}: {type(e).__name__}: {str(e)[:160]}")
                if runner is not None:
                    impls["cuDNN fp8 (e4m3 out)"] = runner
                for name, fn in impls.items():
                    res = fn()
                    err = None
                    if not name.startswith("V^T"):
                        err = rel_error(res[:1, :4].float(), ref)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                    tflops = None if name.startswith("V^T") else work / ms / 1e9
                    rows.append(dict(head_dim=head_dim, seqlen=n, batch=b, heads=h, causal=causal, impl=name, ms=ms,
                                     tflops=tflops, rel_error=err))
                    print(f"d={head_dim} N={n:5d} {'causal' if causal else 'full  '} {name:30s} {ms:8.3f} ms "
                          + (f"{tflops:6.0f} TFLOP/s" if tflops else "") + (f"  err {err:.4f}" if err is not None else ""),
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

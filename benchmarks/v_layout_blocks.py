"""FP8 V^T (backends/cute_sm90/v_layout.py) on the local GPU: the Triton kernel at several block shapes
against torch's strided copy, at 16k tokens (B*N = 16384, heads 2048/d). Medians of
triton.testing.do_bench; GB/s counts V read once and V^T written once.

    python benchmarks/v_layout_blocks.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from attnforge.backends.cute_sm90 import v_layout
from attnforge.backends.cute_sm90 import v_layout_kernel as kernel

BLOCKS = ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128), (32, 128))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for d in (64, 128, 256):  # every shape here divides the blocks (N a multiple of 128, d of 64)
        for n in (1024, 16384):
            b, h = 16384 // n, 2048 // d
            v = torch.randn(b, h, n, d, device="cuda").to(torch.float8_e4m3fn)
            want = v_layout.prepare_v_fp8_torch(v).view(torch.uint8)
            impls = {"torch strided copy": lambda: v_layout.prepare_v_fp8_torch(v)}
            for keys, dims in BLOCKS:
                def run(keys=keys, dims=dims):  # the kernel through Triton's JIT at this block shape
                    out = torch.empty(b, h, d, n, dtype=torch.uint8, device="cuda")
                    raw = v.view(torch.uint8)
                    kernel.transpose_permute_keys[(n // keys, d // dims, b * h)](
                        raw, out, n, n, d, h, *raw.stride()[:3], BLOCK_KEYS=keys, BLOCK_DIMS=dims, num_warps=4)
                    return out
                impls[f"triton {keys}x{dims}"] = run
            for name, fn in impls.items():
                assert torch.equal(fn().view(torch.uint8), want), name
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                gbs = 2 * v.numel() / ms / 1e6
                rows.append(dict(head_dim=d, seqlen=n, batch=b, heads=h, impl=name, ms=ms, gb_per_s=gbs))
                print(f"d={d:3d} N={n:5d} {name:20s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

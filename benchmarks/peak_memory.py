"""Peak device memory of one attnforge.attention() forward at N=16384 (B=1, H=16, d=128), beyond the
inputs: what the call allocates, against its outputs (out and LSE) and its workspaces: for FP8, V^T (the
size of V), and for a cute_sm90 kernel that splits its last wave (tail_split.py), the pieces' fp32 outputs and
LSEs (at most 2 x SMs tiles' worth, whatever N). An N x N score buffer would add 2 * 16 * 16384^2 = 8 GiB in bf16.

    python benchmarks/peak_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import attnforge
from attnforge.backends.cute_sm90 import tail_split
from attnforge.backends.cute_sm90.backend import max_ctas
from attnforge.bench.measure import peak_mem_bytes


def _call_into(outs: list, q, k, v, causal: bool) -> None:
    outs.append(attnforge.attention(q, k, v, causal=causal))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    b, h, n, d = 1, 16, 16384, 128
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, n, d, device="cuda").to(dtype) for _ in range(3))
            attnforge.attention(q, k, v, causal=causal)  # compile, self-check, decide: not part of the call
            outs = []
            extra = peak_mem_bytes(functools.partial(_call_into, outs, q, k, v, causal), q.device)
            out = outs.pop()
            out_bytes = out.numel() * out.element_size() + b * h * n * 4  # out and the fp32 LSE
            workspace = v.numel() * v.element_size() if dtype == torch.float8_e4m3fn else 0  # V^T
            decision = attnforge.last_decision()
            pieces = 0
            if decision.forward.backend == "cute_sm90":
                tile = decision.forward.variant.tile
                if tile.tail_split and not causal:
                    pieces = tail_split.plan(*tail_split.counts(tile, b, h, n, n), max_ctas(q.device)).slots
                    workspace += pieces * tile.tile_m * (d + 1) * 4
            row = dict(dtype=str(dtype), causal=causal, backend=decision.forward.backend, allocated_bytes=extra,
                       outputs_bytes=out_bytes, workspace_bytes=workspace, tail_split_pieces=pieces)
            rows.append(row)
            print(f"{str(dtype):22s} {'causal' if causal else 'full  '} {decision.forward.backend:10s} call allocated "
                  f"{extra / 2**20:7.2f} MiB; out+LSE {out_bytes / 2**20:6.2f} MiB + workspaces {workspace / 2**20:5.2f} MiB "
                  f"(V^T for FP8, {pieces} tail-split pieces)",
                  flush=True)
            del q, k, v, out
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [b, h, n, d], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

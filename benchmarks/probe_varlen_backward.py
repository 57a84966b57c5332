"""cute_sm90's packed (varlen) backward on small packed batches, each in its own process (a kernel fault ends the
process's CUDA context, not the probe), against fp64 math per sequence; then compute-sanitizer (memcheck) on the first
batch that faults, whose report names the kernel and the instruction's offset.

    ATTNFORGE_SELFCHECK=0 python benchmarks/probe_varlen_backward.py OUTDIR [--head-dim 128,64]

Writes OUTDIR/summary.txt (one line per batch: the largest error of dq, dk, dv per sequence, or how the process
ended) and OUTDIR/sanitizer.txt. The kernel is served here whatever bwd_variants.PACKED says. Correctness only: the
speed is benchmarks/bench_varlen.py's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# name -> (query lengths, key lengths, (heads_q, heads_kv), causal)
BATCHES = {
    "one-aligned": ([128], [128], (2, 2), False),
    "two-aligned": ([128, 128], [128, 128], (2, 2), False),
    "one-odd": ([100], [100], (2, 2), False),
    "two-at-100": ([100, 156], [100, 156], (2, 2), False),
    "two-at-100-causal": ([100, 156], [100, 156], (2, 2), True),
    "two-at-100-causal-gqa": ([100, 156], [100, 156], (8, 2), True),
    "one-nq-ne-nk": ([133], [161], (2, 1), False),
    "one-nq-ne-nk-causal": ([133], [161], (2, 1), True),
    "no-queries-first": ([0, 100], [9, 100], (2, 2), False),
    "one-query-first": ([1, 100], [0, 100], (2, 2), False),
    "long-keys-causal": ([113, 100], [4099, 100], (2, 2), True),
    "long-queries-causal": ([4099, 100], [113, 100], (2, 2), True),
    "mixed-causal-gqa": ([17, 0, 1, 1023, 113, 4099, 128, 64], [17, 9, 0, 1023, 4099, 113, 128, 200], (8, 2), True),
    "mixed": ([17, 0, 1, 1023, 113, 4099, 128, 64], [17, 9, 0, 1023, 4099, 113, 128, 200], (4, 4), False),
}


def run_one(name: str, head_dim: int) -> None:
    import torch

    import attnforge
    from attnforge.backends.cute_sm90 import bwd_variants
    from attnforge.testing import oracle

    bwd_variants.PACKED = True
    lengths_q, lengths_k, (hq, hkv), causal = BATCHES[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), hq, head_dim, generator=gen).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(sum(lengths_k), hkv, head_dim, generator=gen).cuda().bfloat16().requires_grad_()
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (lengths_q, lengths_k))
    out = attnforge.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                     backend="cute_sm90")
    backward = attnforge.last_decision().backward
    assert backward.backend == "cute_sm90" and backward.variant.varlen, backward
    dout = torch.randn(out.shape, generator=gen).cuda().bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    errors = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:  # dq (no keys) or dk, dv (no queries) must be 0
            errors.append(max((g[s].abs().max().item() for g, s in zip(grads, (rows, keys, keys)) if s.stop > s.start),
                              default=0.0))
            continue
        bhsd = [t.detach()[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys), (dout, rows))]
        _, _, ref = oracle(*bhsd[:3], causal=causal, dout=bhsd[3])
        for mine, r, s in zip(grads, ref, (rows, keys, keys)):
            errors.append((mine[s].transpose(0, 1)[None].double() - r).abs().max().item())
    print(f"{name} max errors {[round(e, 4) for e in errors]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--head-dim", default="128,64")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (a child process: batch name, head dim)
    args = parser.parse_args(argv)
    if args.one:
        run_one(args.one[0], int(args.one[1]))
        return 0
    os.makedirs(args.outdir, exist_ok=True)
    first_fault = None
    with open(os.path.join(args.outdir, "summary.txt"), "w") as summary:
        for head_dim in map(int, args.head_dim.split(",")):
            for name in BATCHES:
                child = subprocess.run([sys.executable, __file__, args.outdir, "--one", name, str(head_dim)],
                                       capture_output=True, text=True, timeout=300)
                last = (child.stdout + child.stderr).strip().splitlines()[-1:] or ["(no output)"]
                line = f"d={head_dim} {name}: exit {child.returncode}: {last[0][-200:]}"
                print(line, flush=True)
                summary.write(line + "\n")
                if child.returncode and first_fault is None:
                    first_fault = (name, head_dim)
    if first_fault:
        child = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5", sys.executable,
                                __file__, args.outdir, "--one", first_fault[0], str(first_fault[1])],
                               capture_output=True, text=True, timeout=600)
        report = [line for line in (child.stdout + child.stderr).splitlines() if line.startswith("=========")]
        with open(os.path.join(args.outdir, "sanitizer.txt"), "w") as out:
            out.write(f"d={first_fault[1]} {first_fault[0]}\n" + "\n".join(report[:80]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

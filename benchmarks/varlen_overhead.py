"""Where a packed (varlen) forward's time goes on one GPU: attention_varlen per call (CUDA events, its host sync
and host work included) against the chosen kernel alone on the same prepared arguments, and the host pieces
(perf_counter): the decision and offset read, the tile table, the forward's launch path. bench_varlen.py's batch
(16 sequences, 16k tokens, mixed lengths), bf16, d=128, 16 heads, causal and full. FlashAttention-4's varlen
forward on the same inputs when it is installed.

    python benchmarks/varlen_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def host_us(fn, repeats: int = 50) -> float:
    """Median host microseconds of ``fn()`` with the device idle before each call."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import attnforge
    from attnforge import varlen as varlen_api
    from attnforge.api import _causal_mask
    from attnforge.bench.measure import time_ms
    from attnforge.dispatch.registry import get
    from bench_varlen import lengths

    gen = torch.Generator().manual_seed(0)
    seqs, heads, d = lengths(), 16, 128
    total, longest = sum(seqs), max(seqs)
    q, k, v = (torch.randn(total, heads, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    report = dict(device=torch.cuda.get_device_name(), lengths=seqs, rows=[])
    cuda = torch.device("cuda")
    for causal in (True, False):
        with torch.no_grad():
            def call():
                return attnforge.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
            call()
            decision = attnforge.last_decision()
            backend = get(decision.forward.backend)
            variant = decision.forward.variant
            mask = _causal_mask(causal, (-1, -1))

            def decide():
                return varlen_api.decide(q, k, v, cu, cu, longest, longest, mask, None, 0.0, None, None, False, False,
                                         False, None)
            _, prepared = decide()
            row = dict(causal=causal, backend=decision.forward.backend, variant=variant.describe())
            row["attention_varlen ms"] = time_ms(call, cuda, 25, 200)[0]
            row["backend.forward ms (decided call)"] = time_ms(lambda: backend.forward(variant, prepared), cuda, 25, 200)[0]
            if getattr(variant, "varlen", False) and decision.forward.backend == "cute_sm90":
                from attnforge.backends.cute_sm90.backend import run_kernel
                from attnforge.backends.shared.cute_varlen import packed_arguments
                from attnforge.backends.shared.cute_host import LOG2_E, lse_like
                extra = packed_arguments(variant, prepared.varlen)
                out, lse = torch.empty_like(prepared.q), lse_like(prepared.q.shape[:3], q.device)
                row["kernel alone ms"] = time_ms(lambda: run_kernel(
                    variant.kernel, variant.tile, prepared.q, prepared.k, prepared.v, out, lse, d ** -0.5 * LOG2_E,
                    causal=causal, scores=extra), cuda, 25, 200)[0]
                row["tile table host us"] = host_us(lambda: packed_arguments(variant, prepared.varlen))
            row["decide host us"] = host_us(decide)
            row["attention_varlen host us"] = host_us(call)
            try:
                from flash_attn.cute import flash_attn_varlen_func
                row["fa4 varlen ms"] = time_ms(lambda: flash_attn_varlen_func(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                    causal=causal), cuda, 25, 200)[0]
            except ImportError as exc:
                row["fa4"] = f"not run: {exc}"
        print(json.dumps(row))
        report["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

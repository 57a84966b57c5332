"""Chunked prefill against a KV cache on one GPU: a chunk of queries per sequence attending its cached keys and
itself (bottom-right causal), attention_with_kvcache forced onto triton_fa2's split-KV kernel and onto cute_sm90's
KV-cache kernel, on a contiguous cache and on pages of 64 and 16, beside attention() on the same keys as dense
tensors (the dense kernel: what a cache costs it) and FlashAttention-4's flash_attn_varlen_func (seqused_k,
page_table), in the same run, on the same inputs.

Kernel speed, not model speed: one attention call per timing, the chunk already in the cache (no append). Times are
medians of CUDA-event timings, interleaved over rounds (attnforge.bench.measure.interleaved_ms). Reported: TFLOP/s
with FLOPs = 4 * batch * heads_q * head_dim * visible pairs, visible pairs = seqlen_q * (seqlen_k - seqlen_q) +
seqlen_q * (seqlen_q + 1) / 2 per sequence and head. Outputs are checked against fp32 math first, per sequence.

    python benchmarks/bench_kvcache_prefill.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from bench_kvcache import checked_errors, paged_copy  # (this folder: the decode benchmark's helpers)

# (name, batch, cached keys before the chunk, chunk (seqlen_q), heads_q, heads_kv, head_dim)
SHAPES = [("b4-8k+2k", 4, 8192, 2048, 32, 8, 128), ("b1-30k+2k", 1, 30720, 2048, 32, 8, 128),
          ("b8-4k+1k-d64", 8, 4096, 1024, 32, 8, 64)]
PAGES = (64, 16)


def runners(shape, gen) -> tuple[dict, tuple]:
    import attnforge

    _, batch, cached, chunk, hq, hkv, d = shape
    n = cached + chunk
    q = torch.randn(batch, chunk, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(batch, n, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    caches = {"contiguous": (k, v, None)}
    for page in PAGES:
        k_pages, table = paged_copy(k, gen, page)
        v_pages = torch.empty_like(k_pages)
        v_pages[table.long()] = v.reshape(batch, n // page, page, hkv, d)
        caches[f"paged{page}"] = (k_pages, v_pages, table)

    def kvcache(backend, kc, vc, table):
        return lambda: attnforge.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                        causal=True, scale=scale, backend=backend)

    out = {f"attnforge {backend} {layout}": kvcache(backend, *cache) for backend in ("triton_fa2", "cute_sm90")
           for layout, cache in caches.items()}
    out["attnforge dense"] = lambda: attnforge.attention(q, k, v, causal=True, scale=scale, layout="bshd")
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4(kc, vc, table):
            res = flash_attn_varlen_func(q, kc, vc, seqused_k=seqlens, page_table=table, softmax_scale=scale,
                                         causal=True)
            return res[0] if isinstance(res, tuple) else res
        for layout in ("contiguous", "paged64"):
            out[f"fa4 {layout}"] = (lambda cache: lambda: fa4(*cache))(caches[layout])
    except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is absent
        print(f"  FlashAttention-4 not run: {type(exc).__name__}: {str(exc)[:160]}")
    return out, (q, k, v, scale)


def check(fns: dict, inputs) -> dict:
    """Each output against fp32 math on the same keys, sequence by sequence (bottom-right causal); a runner that
    fails is left out, with why. Raises on NaN or on an attnforge error above 4x the dense kernel's + 2^-7."""
    q, k, v, scale = inputs
    nq, nk = q.shape[1], k.shape[1]
    visible = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)
    refs = []
    for b in range(q.shape[0]):
        qb, kb, vb = (t[b].transpose(0, 1).float() for t in (q, k, v))
        kb, vb = (t.repeat_interleave(qb.shape[0] // t.shape[0], 0) for t in (kb, vb))
        refs.append(torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale))
    return checked_errors(fns, lambda name, got: max((got[b].transpose(0, 1).float() - refs[b]).abs().max().item()
                                                     for b in range(len(refs))), peer="attnforge dense")


def main() -> None:
    from attnforge.bench.measure import interleaved_ms

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--rounds", type=int, default=6, help="timing rounds (each runner once per round)")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for shape in SHAPES:
        name, batch, cached, chunk, hq, hkv, d = shape
        fns, inputs = runners(shape, gen)
        errors = check(fns, inputs)
        medians = {k: statistics.median(ms) for k, ms in interleaved_ms(fns, rounds=args.rounds).items()}
        n = cached + chunk
        flops = 4 * batch * hq * d * (chunk * (n - chunk) + chunk * (chunk + 1) / 2)
        rows = {k: {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "max_error": errors[k]} for k, ms in medians.items()}
        print(f"{name}: " + ", ".join(f"{k} {r['tflops']:.0f}" for k, r in rows.items()), flush=True)
        report["shapes"].append({"shape": dict(zip(("name", "batch", "cached", "seqlen_q", "heads_q", "heads_kv",
                                                     "head_dim"), shape)), "runners": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

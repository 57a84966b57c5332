"""Packed (varlen) prefill on one GPU: attention_varlen beside the dense kernel at the same token count,
FlashAttention-4's flash_attn_varlen_func and a loop of dense calls per sequence, in the same run, on the same
inputs; forward, and forward+backward.

Kernel speed, not model speed: one attention call per timing, eager (attention_varlen reads cu_seqlens on the host,
one sync, which the timing includes). Times are medians of CUDA-event timings (triton.testing.do_bench),
interleaved over rounds with the order rotated. TFLOP/s counts each sequence's own work: FLOPs = sum over sequences
of 4 * heads_q * seqlen_q * seqlen_k * head_dim, halved when causal (forward+backward: 3.5x). The dense rows run a
batch of equal sequences (the mean length, rounded to 128) with the same token count. Outputs are checked against
fp32 math per sequence first.

    python benchmarks/bench_varlen.py --json out.json [--rounds 3] [--head-dim 64,128] [--mode fwd]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

TOKENS = 16384
# Document lengths of a packed pretraining batch: long and short sequences side by side, odd lengths included
# (a fixed list, so that every run packs the same batch); filled up to TOKENS by the last one.
MIXED = [4099, 2048, 1500, 1023, 777, 513, 300, 128, 17, 1, 2600, 900, 640, 257, 113]


def lengths(tokens: int = TOKENS) -> list[int]:
    out = []
    for n in MIXED:
        out.append(min(n, tokens - sum(out)))
        if sum(out) == tokens:
            break
    if sum(out) < tokens:
        out.append(tokens - sum(out))
    return out


def flops(seqs: list[int], heads: int, d: int, causal: bool, mode: str) -> float:
    fwd = sum(4 * heads * n * n * d for n in seqs) * (0.5 if causal else 1.0)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def runners(seqs, heads, d, causal, gen, mode):
    import attnforge

    dev, dtype = "cuda", torch.bfloat16
    total = sum(seqs)
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(total, heads, d, generator=gen).to(dev, dtype).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    longest = max(seqs)
    mean = max(128, round(total / len(seqs) / 128) * 128)
    dense = [torch.randn(total // mean, mean, heads, d, generator=gen).to(dev, dtype).requires_grad_(grad)
             for _ in range(3)]
    dout = torch.randn(total, heads, d, generator=gen).to(dev, dtype)
    dense_dout = torch.randn(dense[0].shape, generator=gen).to(dev, dtype)

    def step(fn, out_grad):
        if not grad:
            return lambda: fn()
        return lambda: torch.autograd.backward(fn(), out_grad)

    bounds = cu.tolist()
    fns = {
        "attnforge varlen": step(lambda: attnforge.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal),
                                 dout),
        "attnforge per sequence": step(lambda: torch.cat([
            attnforge.attention(q[a:b][None], k[a:b][None], v[a:b][None], causal=causal, layout="bshd")[0]
            for a, b in zip(bounds, bounds[1:])]), dout),
        "attnforge dense (same tokens)": step(lambda: attnforge.attention(*dense, causal=causal, layout="bshd"),
                                              dense_dout),
        "triton_fa2 dense (same tokens)": step(lambda: attnforge.attention(*dense, causal=causal, layout="bshd",
                                                                          backend="triton_fa2"), dense_dout),
    }
    if grad and torch.cuda.get_device_capability() == (9, 0):
        # cute_sm90's packed forward followed by each backward that can follow it, through the ops (the Decision of
        # the backward op forced to that backend): the pairings side by side on the same inputs. cute_sm90's packed
        # backward is timed whether or not dispatch serves it yet (bwd_variants.PACKED, set for this process).
        from attnforge.backends.cute_sm90 import bwd_variants
        from attnforge.dispatch.select import clear_caches
        from attnforge.op import attention_varlen_backward_op

        if not bwd_variants.PACKED:
            print("  cute_sm90's packed backward is not served by default (bwd_variants.PACKED): served in this run")
            bwd_variants.PACKED = True
            clear_caches()

        scale = d ** -0.5

        def pair(backward):
            def run():
                with torch.no_grad():
                    out, lse = attnforge.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                          return_lse=True, backend="cute_sm90")
                return attention_varlen_backward_op(dout, q, k, v, cu, cu, longest, longest, out, lse, None, causal,
                                                    -1, -1, scale, 0.0, None, None, False, False,
                                                    backward)
            return run
        fns["cute_sm90 fwd + cute_sm90 bwd"] = pair("cute_sm90")
        fns["cute_sm90 fwd + triton_fa2 bwd"] = pair("triton_fa2")
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4():
            res = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                         max_seqlen_k=longest, causal=causal)
            return res[0] if isinstance(res, tuple) else res
        fns["fa4 varlen"] = step(fa4, dout)
    except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is absent
        print(f"  FlashAttention-4 not run: {type(exc).__name__}: {str(exc)[:160]}")
    return fns, (q, k, v, cu, longest, mean)


def check(inputs, causal) -> float:
    """attention_varlen against fp32 math per sequence: the largest error, which must stay near SDPA's bf16 error."""
    import attnforge
    import torch.nn.functional as F

    q, k, v, cu, longest, _ = inputs
    with torch.no_grad():
        out = attnforge.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
        if not torch.isfinite(out).all():
            raise SystemExit("attention_varlen: NaN or inf in the output")
        worst, peer = 0.0, 0.0
        bounds = cu.tolist()
        for a, b in zip(bounds, bounds[1:]):
            args = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*(t.float() for t in args), is_causal=causal)
            mine = F.scaled_dot_product_attention(*args, is_causal=causal)
            worst = max(worst, (out[a:b].transpose(0, 1)[None].float() - ref).abs().max().item())
            peer = max(peer, (mine.float() - ref).abs().max().item())
    if worst > 4 * peer + 2 ** -7:
        raise SystemExit(f"attention_varlen: max error {worst:.3g} against fp32 math, SDPA's bf16 error {peer:.3g}")
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", default="128,64")
    parser.add_argument("--mode", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (comma-separated)")
    args = parser.parse_args(argv)
    import attnforge
    from attnforge.bench.measure import interleaved_ms

    gen = torch.Generator().manual_seed(0)
    seqs = lengths()
    report = dict(device=torch.cuda.get_device_name(), lengths=seqs, rows=[])
    print(f"{len(seqs)} sequences, {sum(seqs)} tokens: {seqs}")
    for d in map(int, args.head_dim.split(",")):
        heads = 2048 // d
        for causal in (True, False):
            for mode in args.mode.split(","):
                fns, inputs = runners(seqs, heads, d, causal, gen, mode)
                error = check(inputs, causal)
                decision = attnforge.last_decision()
                times = interleaved_ms(fns, args.rounds)
                mean = inputs[-1]
                row = dict(head_dim=d, heads=heads, causal=causal, mode=mode, error=error, dense_length=mean,
                           decision=str(decision), results={})
                print(f"d={d} heads {heads} {'causal' if causal else 'full'} {mode}: "
                      f"{decision.forward.backend} ({decision.forward.variant.describe()}), err {error:.2e}")
                for impl, samples in times.items():
                    ms = sorted(samples)[len(samples) // 2]
                    work = (flops([mean] * (sum(seqs) // mean), heads, d, causal, mode) if "dense" in impl
                            else flops(seqs, heads, d, causal, mode))
                    row["results"][impl] = dict(ms=ms, samples=samples, tflops=work / (ms * 1e-3) / 1e12)
                    print(f"  {impl:32s} {ms:8.3f} ms  {row['results'][impl]['tflops']:6.1f} TFLOP/s")
                report["rows"].append(row)
                if args.json:  # after each configuration, so a cut-off run keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode against a KV cache on one GPU: attention_with_kvcache (contiguous and paged) beside SDPA on the same
dense cache and FlashAttention-4's flash_attn_varlen_func (seqused_k, page_table), in the same run, on the
same inputs, with the copy bandwidth of this GPU measured in that run as the roofline.

Kernel speed, not model speed: one attention call per timing (the cache append is not in it). Each is timed
eagerly (host work included: attention_with_kvcache checks the lengths and block table on the host, one sync;
" unchecked" is check_inputs=False, no host read) and replayed from a CUDA graph (" graph": device time only, as a
serving loop that captures decode runs it; attnforge's graph is the check_inputs=False call; a call much shorter
than the graph's launch, as at batch 1, also counts that launch: benchmarks/decode_floor.py times such calls per
layer from a graph of many). Times are medians
of CUDA-event timings (triton.testing.do_bench), interleaved over rounds. Reported: TFLOP/s with FLOPs = 4 * batch
* heads_q * seqlen_q * seqlen_k * head_dim, and KV bandwidth = the bytes of K and V read once (2 * batch *
seqlen_k * heads_kv * head_dim * element size: 1 for the " fp8" rows, an e4m3 copy of the cache) per second. Outputs
are checked against fp32 math on the cache each reads first.

    python benchmarks/bench_kvcache.py --json out.json [--sweep]

``--sweep`` also times the KV-cache kernel's tiles and split counts (what variants.py's table and split
heuristic come from), on the contiguous cache, the pages of 64 and an e4m3 copy of the cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
import torch.nn.functional as F

# (name, batch, seqlen_k, heads_q, heads_kv, head_dim): the serving shapes the KV-cache issue names
SHAPES = [("b64-8k", 64, 8192, 32, 8, 128), ("b1-8k", 1, 8192, 32, 8, 128), ("b16-32k", 16, 32768, 32, 8, 128)]
PAGE = 64


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy (read + write), this GPU's practical roofline."""
    from attnforge.bench.measure import time_ms

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), torch.device("cuda"), 25, 200)[0]
    return 2 * src.numel() / (ms * 1e-3)


def paged_copy(cache: torch.Tensor, gen, page: int = PAGE) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (B, N, H, D) cache as pages of ``page`` positions in a shuffled pool, and the block table."""
    batch, n = cache.shape[:2]
    per_seq = n // page
    table = torch.randperm(batch * per_seq, generator=gen).to(torch.int32).reshape(batch, per_seq).cuda()
    pool = torch.empty((batch * per_seq, page, *cache.shape[2:]), dtype=cache.dtype, device="cuda")
    pool[table.long()] = cache.reshape(batch, per_seq, page, *cache.shape[2:])
    return pool, table


def graphed(fn):
    """``fn`` captured into a CUDA graph (after a warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def runners(shape, gen):
    import attnforge

    name, batch, n, hq, hkv, d = shape
    dev = "cuda"
    q = torch.randn(batch, 1, hq, d, generator=gen).to(dev, torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, n, hkv, d, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    seqlens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    k_pages, table = paged_copy(k_cache, gen)
    v_pages = torch.empty_like(k_pages)
    v_pages[table.long()] = v_cache.reshape(batch, n // PAGE, PAGE, hkv, d)
    scale = d ** -0.5
    out = {
        "attnforge": lambda: attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, scale=scale),
        "attnforge-paged64": lambda: attnforge.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                                      block_table=table, scale=scale),
        "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                                       v_cache.transpose(1, 2), scale=scale,
                                                       enable_gqa=True).transpose(1, 2),
    }
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4(kc, vc, pt):
            res = flash_attn_varlen_func(q, kc, vc, seqused_k=seqlens, page_table=pt, softmax_scale=scale, num_splits=1)  # sm90: no split-KV in FA4
            return res[0] if isinstance(res, tuple) else res
        out["fa4"] = lambda: fa4(k_cache, v_cache, None)
        out["fa4-paged64"] = lambda: fa4(k_pages, v_pages, table)
    except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is absent
        print(f"  FlashAttention-4 not run: {type(exc).__name__}: {str(exc)[:160]}")
    out["attnforge unchecked"] = lambda: attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                                          scale=scale, check_inputs=False)
    out["attnforge-paged64 unchecked"] = lambda: attnforge.attention_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, scale=scale, check_inputs=False)
    out["attnforge graph"] = graphed(out["attnforge unchecked"])
    out["attnforge-paged64 graph"] = graphed(out["attnforge-paged64 unchecked"])
    # the same cache in e4m3 (descale 1): half the bytes to read
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    out["attnforge fp8"] = lambda: attnforge.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, scale=scale)
    out["attnforge fp8 graph"] = graphed(lambda: attnforge.attention_with_kvcache(
        q, k8, v8, cache_seqlens=seqlens, scale=scale, check_inputs=False))
    for name in ("sdpa", "fa4", "fa4-paged64"):
        if name in out:
            try:
                out[f"{name} graph"] = graphed(out[name])
            except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly only
                print(f"  {name}: not captured in a CUDA graph ({type(exc).__name__}: {str(exc)[:120]})")
    refs = {cache: F.scaled_dot_product_attention(q.float().transpose(1, 2), kc.float().transpose(1, 2),
                                                  vc.float().transpose(1, 2), scale=scale, enable_gqa=True).transpose(1, 2)
            for cache, kc, vc in (("bf16", k_cache, v_cache), ("fp8", k8, v8))}
    return out, refs, (q, k_cache, v_cache, seqlens, scale, k_pages, v_pages, table)


def check(fns, refs) -> dict:
    """Each eager output against fp32 math on the cache it reads (the bf16 one, or the fp8 one's values)."""
    return checked_errors(fns, lambda name, got: (got.float() - refs["fp8" if "fp8" in name else "bf16"]).abs().max().item(),
                          peer="sdpa")


def checked_errors(fns: dict, error, peer: str) -> dict:
    """{name: error(name, output)} of each eager runner of ``fns`` (a graph replay returns nothing: its eager twin's
    output is checked). A runner that raises is left out (removed from ``fns``, with why); NaN or inf in an output, or
    an attnforge runner's error above 4x the ``peer`` runner's + 2^-7, ends the run."""
    errors = {}
    for name, fn in list(fns.items()):
        if name.endswith(" graph"):
            continue
        try:
            with torch.no_grad():
                got = fn()
        except Exception as exc:  # noqa: BLE001 - a runner that cannot take this shape is left out, with why
            print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:200]}); left out")
            del fns[name]
            continue
        if not torch.isfinite(got).all():
            raise SystemExit(f"{name}: NaN or inf in the output")
        errors[name] = error(name, got)
    bound = 4 * errors.get(peer, 0.0) + 2 ** -7
    for name, err in errors.items():
        if name.startswith("attnforge") and err > bound:
            raise SystemExit(f"{name}: max error {err:.3g} against fp32 math ({peer}'s: {errors[peer]:.3g})")
    return errors


SWEEP_LAYOUTS = {"contiguous": "sweep", "paged64": "sweep_paged64", "fp8": "sweep_fp8"}  # layout -> report key


def sweep(shape, inputs, layout: str = "contiguous") -> list[dict]:
    """The KV-cache kernel's tiles x split counts on ``shape`` (``layout``: the contiguous cache, the pages of 64, or
    an e4m3 copy of the contiguous cache with descales 1, its kernel's FP8_KV form), each replayed from a CUDA
    graph; KV bandwidth counts the bytes each layout holds (1 per element for fp8)."""
    from attnforge.backends.triton_fa2.backend import TritonVariant
    from attnforge.backends.triton_fa2.variants import KVTile
    from attnforge.dispatch.call import Call, KVCache
    from attnforge.dispatch.mask import Mask
    from attnforge.dispatch.registry import get
    from attnforge.bench.measure import time_ms

    _, batch, n, hq, hkv, d = shape
    q, k_cache, v_cache, seqlens, scale, k_pages, v_pages, table = inputs
    paged, fp8 = layout == "paged64", layout == "fp8"
    k, v, table = (k_pages, v_pages, table) if paged else (k_cache, v_cache, None)
    descale = None
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        descale = torch.ones(2, batch, hkv, dtype=torch.float32, device=k.device)
    element_bytes = 1 if fp8 else 2
    backend = get("triton_fa2")
    rows = []
    block_ns = (64, 128, 256) if fp8 else (64, 128)  # (fp8: half the bytes a key, so longer steps fit)
    for block_n, warps, stages, splits in itertools.product(block_ns, (4, 8), (2, 3), (0, 1, 2, 4, 8, 16, 32)):
        tile = KVTile(16, block_n, warps, stages)
        variant = TritonVariant("kvcache", tile, "triton_kvcache.py.jinja", "sm90", d, "bf16", False, paged=paged,
                                kv_dtype="fp8" if fp8 else "")
        call = Call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, Mask(),
                    cache=KVCache(seqlens, None, table, n, splits, descale))
        try:
            replay = graphed(lambda: backend.forward(variant, call))
            ms = time_ms(replay, torch.device("cuda"), 10, 60)[0]
        except Exception as exc:  # noqa: BLE001 - out of resources: recorded, not fatal
            rows.append(dict(tile=tile.describe(), splits=splits, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        rows.append(dict(tile=tile.describe(), splits=splits, ms=ms,
                         kv_tbs=2 * batch * n * hkv * d * element_bytes / (ms * 1e-3) / 1e12))
    return sorted(rows, key=lambda r: r.get("ms", math.inf))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's tiles and split counts")
    args = parser.parse_args(argv)
    from attnforge.bench.measure import interleaved_ms

    gen = torch.Generator().manual_seed(0)
    copy = copy_bandwidth()
    print(f"copy bandwidth: {copy / 1e12:.2f} TB/s (read + write)")
    report = dict(device=torch.cuda.get_device_name(), copy_tbs=copy / 1e12, shapes=[])
    for shape in SHAPES:
        name, batch, n, hq, hkv, d = shape
        fns, refs, inputs = runners(shape, gen)
        errors = check(fns, refs)
        with torch.no_grad():
            times = interleaved_ms(fns, args.rounds)
        flops = 4 * batch * hq * 1 * n * d
        kv_elements = 2 * batch * n * hkv * d
        row = dict(shape=name, batch=batch, seqlen_k=n, heads=f"{hq}/{hkv}", head_dim=d, errors=errors, results={})
        print(f"{name}: batch {batch}, {n} keys, heads {hq}/{hkv}, d={d}, bf16, one query")
        for impl, samples in times.items():
            ms = sorted(samples)[len(samples) // 2]
            kv_bytes = kv_elements * (1 if "fp8" in impl else 2)  # the bytes this one reads: e4m3 or bf16
            row["results"][impl] = dict(ms=ms, samples=samples, tflops=flops / (ms * 1e-3) / 1e12,
                                        kv_tbs=kv_bytes / (ms * 1e-3) / 1e12)
            r = row["results"][impl]
            print(f"  {impl:18s} {ms * 1e3:8.1f} us  {r['tflops']:6.1f} TFLOP/s  {r['kv_tbs']:5.2f} TB/s KV "
                  f"({r['kv_tbs'] * 1e12 / copy:.0%} of copy)" + (f"  err {errors[impl]:.2e}" if impl in errors else ""))
        if args.sweep:
            for layout, key in SWEEP_LAYOUTS.items():
                row[key] = sweep(shape, inputs, layout)
                for r in row[key][:6]:
                    print(f"    {key} {r['tile']:28s} splits {r['splits']:3d}: {r.get('ms', 0) * 1e3:8.1f} us "
                          f"{r.get('kv_tbs', 0):5.2f} TB/s")
        report["shapes"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

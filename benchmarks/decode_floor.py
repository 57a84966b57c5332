"""Decode at batch 1: one query per sequence, 8k cached keys, GQA 32/8, d=128, bf16 (the smallest decode shape of
docs/performance.md: 33.5 MB of K and V per call), on one GPU, every runner in the same run on the same inputs.

A call this small is over in ~15 us, so how it is timed decides what is seen:
- "layers": one CUDA graph of LAYERS calls, each on its own cache (as a model's decode step runs its layers, and
  LAYERS x 33.5 MB is far more than L2 holds), replayed; time per call = the replay's time / LAYERS. This is the
  device time a serving loop pays per layer.
- "one call": a graph of a single call, replayed: the time between the events also holds the graph launch, which
  the GPU waits for when the call is shorter than the host's launch.
Both are medians of CUDA-event timings (triton.testing.do_bench, L2 flushed before each replay). Beside them: a
device copy of the same bytes (16.8 MB to 16.8 MB: 33.5 MB moved, as a decode reads its cache once), the 2 GiB copy
bandwidth (the roofline docs/performance.md measures decode against), SDPA (enable_gqa) on the same caches, and
one "layers" replay under torch.profiler: each kernel's own device time. KV bandwidth = K and V bytes read once per
call / time. Outputs are checked against fp32 math first. Kernel speed, not model speed.

``--paged`` adds the same caches as pages of 64 in a shuffled pool (bench_kvcache.paged_copy), through the call and at
8, 16, 32 and 64 splits (or ``--splits``); ``--sweep`` adds the KV-cache kernel's tiles at those split counts, contiguous and paged,
each timed per layer the same way (through the backend's forward, as bench_kvcache.py --sweep does).

    python benchmarks/decode_floor.py [--layers 16] [--batch 1] [--paged] [--splits 8,16,32] [--sweep [--tiles 16,128,4,2;...]]
        [--json out.json]

A fifth field of a --tiles entry, 1, turns the tile's `lookahead` on (block-table entries read a key step ahead):
``--paged --sweep --tiles "16,128,4,2;16,128,4,2,1"`` times a paged tile beside its lookahead twin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from bench_kvcache import copy_bandwidth, graphed, paged_copy  # noqa: E402 (run from benchmarks/, which Python puts on the path)

BATCH, SEQLEN, HEADS_Q, HEADS_KV, HEAD_DIM = 1, 8192, 32, 8, 128


def graph_of(fns):
    """One CUDA graph running ``fns`` in order: its replay (bench_kvcache.graphed of their sequence)."""
    return graphed(lambda: [fn() for fn in fns])


# (block_m, block_n, warps, stages[, lookahead]) of the KV-cache kernel, swept with --sweep
SWEEP_TILES = ((16, 128, 4, 2), (16, 128, 4, 3), (16, 128, 8, 3), (16, 64, 4, 3), (16, 64, 8, 4))


def forced(q, kc, vc, seqlens, tile, splits, paged=None):
    """A call of triton_fa2's KV-cache kernel with ``tile`` and ``splits``, through the backend's forward; ``paged``:
    (K pages, V pages, block table) of the same cache."""
    from attnforge.backends.triton_fa2.backend import TritonVariant
    from attnforge.backends.triton_fa2.variants import KVTile
    from attnforge.dispatch.call import Call, KVCache
    from attnforge.dispatch.mask import Mask
    from attnforge.dispatch.registry import get

    table = None
    if paged is not None:
        kc, vc, table = paged
    kv_tile = KVTile(*tile[:4], lookahead=len(tile) > 4 and bool(tile[4]))
    variant = TritonVariant("kvcache", kv_tile, "triton_kvcache.py.jinja", "sm90", HEAD_DIM, "bf16", False,
                            paged=table is not None)
    call = Call(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), HEAD_DIM ** -0.5, Mask(),
                cache=KVCache(seqlens, None, table, SEQLEN, splits, None))
    backend = get("triton_fa2")
    return lambda: backend.forward(variant, call)[0].transpose(1, 2)


def median_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median") * 1e3


def main(argv=None) -> int:
    import attnforge

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--paged", action="store_true", help="also the caches in pages of 64")
    p.add_argument("--sweep", action="store_true", help="also the KV-cache kernel's tiles (with --paged: paged too)")
    p.add_argument("--tiles", help="--sweep's tiles: block_m,block_n,warps,stages[,lookahead];... (default SWEEP_TILES)")
    p.add_argument("--splits", help="split counts timed beside the heuristic's (default 8,16,32; paged and swept:"
                   " 8,16,32,64)")
    p.add_argument("--batch", type=int, default=BATCH, help="sequences per call (default 1)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    batch = args.batch
    tiles = (SWEEP_TILES if not args.tiles else
             tuple(tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";")))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    caches = [tuple(torch.randn(batch, SEQLEN, HEADS_KV, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
                    for _ in range(2)) for _ in range(args.layers)]
    seqlens = torch.full((batch,), SEQLEN, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * caches[0][0].numel() * caches[0][0].element_size()
    copy_bps = copy_bandwidth()
    src = [torch.empty(kv_bytes // 2, dtype=torch.uint8, device="cuda") for _ in range(args.layers)]
    dst = [torch.empty_like(s) for s in src]

    def ours(kc, vc, splits=0):
        return lambda: attnforge.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits,
                                                        check_inputs=False)

    def sdpa(kc, vc):
        return lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                      enable_gqa=True)

    makers = {"attnforge (heuristic splits)": ours, "sdpa": sdpa, "copy of the same bytes": None}
    asked = tuple(int(x) for x in args.splits.split(",")) if args.splits else None
    split_counts, more_splits = (asked, asked) if asked else ((8, 16, 32), (8, 16, 32, 64))
    for splits in split_counts:
        makers[f"attnforge {splits} splits"] = lambda kc, vc, s=splits: ours(kc, vc, s)
    pages = {}  # id of a layer's K cache -> (its K pages, V pages, block table)
    if args.paged:
        for kc, vc in caches:
            kp, table = paged_copy(kc, gen)
            vp = torch.empty_like(kp)
            vp[table.long()] = vc.reshape(batch, -1, *kp.shape[1:])
            pages[id(kc)] = (kp, vp, table)

        def paged(kc, vc, splits=0):
            kp, vp, table = pages[id(kc)]
            return lambda: attnforge.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                            num_splits=splits, check_inputs=False)

        makers["attnforge paged64 (heuristic splits)"] = paged
        for splits in more_splits:
            makers[f"attnforge paged64 {splits} splits"] = lambda kc, vc, s=splits: paged(kc, vc, s)
    if args.sweep:
        for layout in ("contiguous", "paged64") if args.paged else ("contiguous",):
            for tile in tiles:
                for splits in more_splits:
                    makers[f"{layout} {tile} {splits} splits"] = (
                        lambda kc, vc, t=tile, s=splits, lay=layout: forced(q, kc, vc, seqlens, t, s,
                                                                             pages.get(id(kc)) if lay != "contiguous"
                                                                             else None))

    # correctness first: against fp32 math on the first cache
    kc, vc = caches[0]
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), kc.float().transpose(1, 2),
                                         vc.float().transpose(1, 2), enable_gqa=True).transpose(1, 2)
    bound = 4 * (sdpa(kc, vc)().transpose(1, 2).float() - ref).abs().max().item() + 2 ** -7
    for name, make in makers.items():
        if make is not None and name != "sdpa":
            err = (make(kc, vc)().float() - ref).abs().max().item()
            if not err <= bound:
                raise SystemExit(f"{name}: max error {err:.3g} against fp32 math (bound {bound:.3g})")

    rows = {"batch": batch, "kv_bytes": kv_bytes, "copy_2gib_bytes_per_s": copy_bps, "layers": args.layers,
            "runners": {}}
    replays = {}  # name -> the replay of its graph of LAYERS calls
    for name, make in makers.items():
        if make is None:
            calls = [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)]
        else:
            calls = [make(kc, vc) for kc, vc in caches]
        replays[name] = graph_of(calls)
        per_layer = median_us(replays[name]) / args.layers
        one = median_us(graph_of(calls[:1]))
        rows["runners"][name] = {"layers_us_per_call": per_layer, "one_call_us": one}
        print(f"{name:32s} layers: {per_layer:7.2f} us/call, {kv_bytes / per_layer / 1e6:5.2f} TB/s "
              f"({kv_bytes / per_layer / 1e6 / (copy_bps / 1e12):.2f} of the 2 GiB copy)   one call: {one:6.2f} us",
              flush=True)

    from torch.profiler import ProfilerActivity, profile

    name = "attnforge (heuristic splits)"  # its kernels' own device times, per layer
    for _ in range(10):
        replays[name]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            replays[name]()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    rows["profiled_us"] = {name: {kernel: statistics.median(times) for kernel, times in kernels.items()}}
    for kernel, times in kernels.items():
        print(f"  {name}: kernel {kernel[:40]:40s} x{len(times)} median {statistics.median(times):.2f} us", flush=True)
    print(f"2 GiB copy: {copy_bps / 1e12:.3f} TB/s; 80% of it for {kv_bytes / 1e6:.1f} MB: "
          f"{kv_bytes / (0.8 * copy_bps) * 1e6:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where each CTA's time goes in a cute_sm90 backward: the table's kernel instrumented with clock reads.

Renders the table's backward kernel for a head dim and mask, patches the rendered source so that one thread per
role writes the SM clock at a few points of every CTA (into the int32 dQ-order tensor, which a non-deterministic
kernel does not read, passed 16 slots per CTA), runs it once on fresh random inputs and prints, per SM, how the
CTAs it ran follow one another:

  start -> consumers     kernel entry (barrier init, descriptor prefetch) to the consumer warpgroups' first line
  consumers -> K/V       the consumers' set-up to K and V landed in shared memory
  K/V -> loop end        the query-block loop (all of the CTA's steps)
  loop end -> stored     dK and dV scaled, converted and stored (the epilogue)
  dQ warp after          when the dQ warp finished its last reduce-add, from the consumers' end (negative: before it)
  gap                    the previous CTA's last recorded point on this SM to this CTA's entry: the launch of a new
                         CTA once the previous one has exited

Cycles are per SM (each SM's clock); the global nanosecond timer places the CTAs in the kernel. Diagnostic only:
the clock reads and stores perturb the schedule a little.

With --persistent the tile's persistent twin (Sm90BwdTile.persistent) runs, and each tile (key block) a CTA runs is
traced as a CTA is above: its entry is the consumers taking it, the dQ warp's end its last reduce-add issued, and the
gap runs from the SM's previous tile's last recorded point to the consumers taking this one (negative: the consumers
took it before the dQ warp was done with the previous one).

    python benchmarks/timeline_bwd_sm90.py --head-dim 128 --seqlen 1024 --causal [--persistent] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import tempfile

import torch

from attnforge.backends.cute_sm90 import backward
from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.backends.cute_sm90 import compile as cc
from attnforge.runtime import cute
from attnforge.runtime.generated import import_path

SLOTS = 16  # trace slots per CTA
EVENTS = {"sm": 0, "entry_ns": 1, "entry": 2, "consumers": 3, "kv_landed": 4, "loop_end": 5, "stored": 6,
          "dq_end": 7, "producer_end": 8, "steps": 9}


def _record(event: str, value: str, indent: str) -> str:
    return f"{indent}mdQorder[trace_n * {SLOTS} + {EVENTS[event]}, trace_h, trace_b] = cutlass.Int32({value})\n"


def patch(source: str) -> str:
    """Add the clock reads to a rendered cute_sm90 backward module (each replacement must apply exactly once)."""
    def sub(old, new, count=1):
        nonlocal source
        assert source.count(old) == count, f"patch does not apply ({source.count(old)}x): {old[:70]!r}"
        source = source.replace(old, new)

    clock = "cute.arch.clock()"
    entry = "        n_block, head_kv, batch = self.block_coordinates(mK)\n"
    sub(entry, entry + "        trace_n, trace_h, trace_b = n_block, head_kv, batch\n"
        "        if tidx == 0 and not self.persistent:\n"
        + _record("sm", "cute.arch.smid()", " " * 12) + _record("entry_ns", "cute.arch.globaltimer_lo()", " " * 12)
        + _record("entry", clock, " " * 12))
    # a persistent kernel's roles trace each tile at its own coordinates, its entry where the consumers take it; its
    # tile counter moves to the first tile's last slot, which no event uses
    sub("storage.sTile.get_tensor(cute.make_layout(TILE_SLOTS)), mdQorder.iterator)",
        f"storage.sTile.get_tensor(cute.make_layout(TILE_SLOTS)), mdQorder.iterator + {SLOTS - 1})")
    sub("m_remasked, m_end, seqlen_q, seqlen_k, *scores, carried=(kv_state, state))",
        "m_remasked, m_end, seqlen_q, seqlen_k, *scores, carried=(kv_state, state),\n"
        "                                           mdQorder=mdQorder, trace_n=n_block, trace_h=head_kv, trace_b=batch)")
    sub("self.consume_tiles(consumer, scores, tiles, mK, offsets, group, seqlen_q, seqlen_k)",
        "self.consume_tiles(consumer, scores, tiles, mK, offsets, group, seqlen_q, seqlen_k, mdQorder)")
    sub("def consume_tiles(self, consumer, scores, tiles, mK, offsets, group, seqlen_q, seqlen_k):",
        "def consume_tiles(self, consumer, scores, tiles, mK, offsets, group, seqlen_q, seqlen_k, mdQorder):")
    sub("self.load_tiles(loads, tiles, mK, offsets, group, seqlen_q, seqlen_k, window)",
        "self.load_tiles(loads, tiles, mK, offsets, group, seqlen_q, seqlen_k, window, mdQorder)")
    sub("def load_tiles(self, loads, tiles, mK, offsets, group, seqlen_q, seqlen_k, window):",
        "def load_tiles(self, loads, tiles, mK, offsets, group, seqlen_q, seqlen_k, window, mdQorder):")
    sub("                                        carried=(kv_state, state))",
        "                                        carried=(kv_state, state), mdQorder=mdQorder, trace_n=n_block,\n"
        "                                        trace_h=head_kv, trace_b=batch)")
    dq_tile = ("                          seqlen_q, seqlen_k, last=False)\n")
    sub(dq_tile, "                          seqlen_q, seqlen_k, last=False)\n            trace_n, trace_h, trace_b = n_block, "
        "head_kv, batch\n            if cute.arch.lane_idx() == 0:\n" + _record("dq_end", clock, " " * 16))
    # the consumers, the producer and the dQ warp get the trace tensor and the CTA's coordinates (as keywords, after
    # their last parameter, which PERSISTENT kernels pass)
    traced = ", mdQorder=mdQorder, trace_n=trace_n, trace_h=trace_h, trace_b=trace_b)"
    parameters = ", mdQorder=None, trace_n=None, trace_h=None, trace_b=None):"
    sub("seqlen_q, seqlen_k, *scores)\n\n    def epilogue_staging", "seqlen_q, seqlen_k, *scores" + traced
        + "\n\n    def epilogue_staging")
    sub("window, cap_scale, mAlibi, carried=None):\n        \"\"\"The consumer warpgroups",
        "window, cap_scale, mAlibi, carried=None" + parameters + "\n        \"\"\"The consumer warpgroups")
    first = "        sK, sV, sQ, sdO, sLSE, sDelta = smem\n        wg = "
    sub(first, "        if tidx == 0:\n" + _record("consumers", clock, " " * 12)
        + "            if const_expr(carried is not None):\n" + _record("sm", "cute.arch.smid()", " " * 16)
        + _record("entry_ns", "cute.arch.globaltimer_lo()", " " * 16) + _record("entry", clock, " " * 16) + first)
    landed = "  # K (and V)\n"
    sub(landed, landed + "        if tidx == 0:\n" + _record("kv_landed", clock, " " * 12)
        + _record("steps", "m_end - m_first", " " * 12))
    scale_dk = "        for r in cutlass.range_constexpr(cute.size(acc_dK)):\n            acc_dK[r] = acc_dK[r] * scale\n"
    sub(scale_dk, "        if tidx == 0:\n" + _record("loop_end", clock, " " * 12) + scale_dk)
    end = ("        if const_expr(carried is not None):\n            return kv_state, state\n"
           "        return self.states(state, state_do)\n\n    @cute.jit\n    def features(")
    sub(end, "        if tidx == 0:\n" + _record("stored", clock, " " * 12) + end)
    sub("m_first, m_end,\n                                  seqlen_q, seqlen_k)\n",
        "m_first, m_end,\n                                  seqlen_q, seqlen_k, trace_n=trace_n, trace_h=trace_h, "
        "trace_b=trace_b)\n")
    sub("m_first, m_end, seqlen_q,\n                 seqlen_k, last=True):\n",
        "m_first, m_end, seqlen_q,\n                 seqlen_k, last=True, trace_n=None, trace_h=None, trace_b=None):\n")
    dq_wait = "            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the staging buffers are read before the CTA exits\n"
    sub(dq_wait, dq_wait + "            if cute.arch.lane_idx() == 0:\n" + _record("dq_end", clock, " " * 16))
    sub("self.load(*loads, n_block, head_kv, batch, offsets, group, m_first, m_end)\n",
        "self.load(*loads, n_block, head_kv, batch, offsets, group, m_first, m_end" + traced + "\n")
    sub("             pipe_kv, pipe_q, pipe_do, n_block, head_kv, batch, offsets, group, m_first, m_end, carried=None):\n",
        "             pipe_kv, pipe_q, pipe_do, n_block, head_kv, batch, offsets, group, m_first, m_end, carried=None"
        + parameters + "\n")
    load_end = ("        if const_expr(carried is not None):\n            kv_state.advance()\n            return kv_state, state\n"
                "        return self.states(state, state_do)\n\n    @cute.jit\n    def load_block(")
    sub(load_end, _record("producer_end", clock, " " * 8) + load_end)
    return source


def summarize(trace: torch.Tensor, n_blocks: int) -> dict:
    """Per-CTA phases (cycles) and, per SM, the gaps between consecutive CTAs."""
    t = trace.view(-1, SLOTS).long()  # (CTAs, slots): CTA order (batch, head, n_block)
    ctas = []
    for row in t.tolist():
        e = {name: row[i] for name, i in EVENTS.items()}
        rel = lambda a, b: (e[b] - e[a] + (1 << 31)) % (1 << 32) - (1 << 31)  # noqa: E731 (signed, 32-bit clocks)
        ctas.append({"sm": e["sm"], "entry_ns": e["entry_ns"] % (1 << 32), "entry": e["entry"] % (1 << 32),
                     "steps": e["steps"], "to_consumers": rel("entry", "consumers"),
                     "to_kv": rel("consumers", "kv_landed"), "loop": rel("kv_landed", "loop_end"),
                     "epilogue": rel("loop_end", "stored"), "dq_after": rel("stored", "dq_end"),
                     "end": e["entry"] % (1 << 32) + max(rel("entry", "stored"), rel("entry", "dq_end"),
                                                          rel("entry", "producer_end"))})
    first_ns = min(c["entry_ns"] for c in ctas)
    by_sm: dict[int, list] = {}
    for c in ctas:
        by_sm.setdefault(c["sm"], []).append(c)
    gaps = []
    for runs in by_sm.values():
        runs.sort(key=lambda c: (c["entry_ns"] - first_ns) % (1 << 32))
        gaps += [(b["entry"] - a["end"] + (1 << 31)) % (1 << 32) - (1 << 31) for a, b in zip(runs, runs[1:])]
    med = lambda key: statistics.median(c[key] for c in ctas)  # noqa: E731
    by_steps: dict[int, list] = {}
    for c in ctas:
        by_steps.setdefault(c["steps"], []).append(c["loop"])
    return {"ctas": len(ctas), "sms": len(by_sm), "median_cycles": {
        "start -> consumers": med("to_consumers"), "consumers -> K/V": med("to_kv"), "loop": med("loop"),
        "epilogue": med("epilogue"), "dQ warp after the epilogue": med("dq_after"),
        "gap between CTAs": statistics.median(gaps) if gaps else None},
        "loop_cycles_by_steps": {s: statistics.median(v) for s, v in sorted(by_steps.items())},
        "ctas_per_sm": statistics.median(len(v) for v in by_sm.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--persistent", action="store_true", help="the tile's persistent twin (Sm90BwdTile.persistent)")
    p.add_argument("--json")
    args = p.parse_args()
    d, n = args.head_dim, args.seqlen
    tile, reasons = bwd_variants.pick(d, masked=args.causal or args.persistent)  # (80 rows do not fit persistent)
    assert tile is not None, reasons
    if args.persistent:
        tile = dataclasses.replace(tile, persistent=True)
        assert bwd_variants.check(tile, d) == [], bwd_variants.check(tile, d)
    variant = backward.Sm90BwdVariant(tile, d, "bf16", args.causal)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="cute_sm90_bwd_timeline_"))
    path = folder / f"{variant.source.name}_trace.py"
    path.write_text(patch(variant.source.text()))
    cute.target(cc.ARCH)  # before the patched module imports cutlass
    mod = import_path(path, f"{variant.source.name}_trace")
    kernel = cute.compile_kernel(variant.build, module=mod)

    b, h = max(args.tokens // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    scale = d ** -0.5
    from attnforge import attention
    out, lse = attention(q, k, v, causal=args.causal, scale=scale, return_lse=True, backend="cute_sm90")
    q_, k_, v_, do_ = (backward.tma_ready(t) for t in (q, k, v, dout))
    flat = backward.FlatDqOrder.of(tile, d) if tile.flat_dq else None
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device="cuda") if flat is None else flat.accumulator(q_)
    lse2, delta = backward.row_statistics(out, dout, lse, None, tile.tile_m, dq_accum=dq_accum)
    n_blocks = math.ceil(n / tile.tile_n)
    trace = torch.zeros((b, h, n_blocks * SLOTS), dtype=torch.int32, device="cuda")
    dk, dv = torch.empty_like(k_), torch.empty_like(v_)
    for _ in range(3):  # the last run's trace is read
        trace.zero_()  # (a persistent kernel's tile counter lives in it)
        ctas = (backward.max_ctas(q.device),) if tile.persistent else ()
        kernel(q_, k_, v_, do_, lse2, delta, dq_accum, trace, dk, dv, scale * backward.LOG2_E, scale, *ctas)
    torch.cuda.synchronize()
    report = {"variant": variant.describe(), "head_dim": d, "seqlen": n, "batch": b, "heads": h,
              "causal": args.causal, "device": torch.cuda.get_device_name(), **summarize(trace.cpu(), n_blocks)}
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Where one CTA's time goes, per key block: a cute_sm90 variant instrumented with SM clock reads.

Renders a variant, patches the rendered source so that thread 0 of each consumer warpgroup of one CTA
writes `clock()` (cycles since its first step) at seven points of every key block, reusing the LSE
tensor as the trace buffer (the LSE is not written in this build), runs it once and prints, per phase,
the median cycles over the middle blocks. Diagnostic only: the clock reads and stores perturb the
schedule a little, and the trace CTA is one of many.

Phases of one block (template `step`):
  wait K+turn   K's TMA load landed, and with pingpong, this warpgroup's turn to issue GEMMs
  issue QK      issue S = Q K^T
  wait V        V's TMA load landed
  issue PV      issue O += P V (and pass the turn on)
  wait S        S's WGMMA done
  softmax       mask, row max, exp2, row sums
  wait PV       the P V WGMMA done
  P, rescale    P into the A operand of the next P V, O rescaled
The producer's thread records when each K and V slot came free and when its load was issued.

    python benchmarks/timeline_cute_sm90.py --kind fp8 --tile 128x128 [--warpgroups 2] [--stages 2] [--seqlen 16384]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import tempfile

import torch

from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.backend import max_ctas
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.backends.cute_sm90.variants import WG2, WG3, Sm90FwdTile, check
from attnforge.codegen import Source
from attnforge.runtime import cute
from attnforge.runtime.generated import import_path

EVENTS = 16  # trace slots per block (9 used by a consumer, 4 by the producer)
SLOTS = 4096  # trace slots per consumer warpgroup (>= EVENTS x blocks at N=16k); the producer's follow the third
PRODUCER_BASE = 3 * SLOTS
PHASES = ["wait K+turn", "issue QK", "wait V", "issue PV", "wait S", "softmax", "wait PV", "P, rescale"]
PRODUCER = ["K slot free", "K issued", "V slot free", "V issued"]


def _trace_start(trace_m: int, trace_h: int, condition: str, base: str) -> str:
    """Source lines that read the start clock and set trace_base (-1: this thread does not trace)."""
    return ("        t0 = cute.arch.clock()\n"
            "        trace_base = cutlass.Int32(-1)\n"
            f"        if m_block == {trace_m} and head == {trace_h} and batch == 0 and {condition}:\n"
            f"            trace_base = {base}\n")


def patch(source: str, trace_m: int, trace_h: int) -> str:
    """Add the clock reads to a rendered cute_sm90 module (each replacement must apply exactly once)."""
    def sub(old, new, count=1):
        nonlocal source
        assert source.count(old) == count, f"patch does not apply: {old[:60]!r}"
        source = source.replace(old, new)

    sub("        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)\n",
        "        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)\n"
        + _trace_start(trace_m, trace_h, "tidx % THREADS_PER_WG == 0", f"wg * {SLOTS}"))
    # the masked step is called from two loops: the right edge's and (with WINDOW, traced too) the left edge's
    for flag, calls in (("True", 2), ("False", 1)):
        sub(f"scale_log2, wg, scores, {flag})\n", f"scale_log2, wg, scores, {flag}, mLSE, trace_base, t0)\n", calls)
    sub("masked: cutlass.Constexpr):\n", "masked: cutlass.Constexpr, mLSE, trace_base, t0):\n")
    # the consumer's nine points, each read just before the line named (event = position in this list)
    marks = ["        pipe_k.consumer_wait(state)\n        if const_expr(PINGPONG):",
             "        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((TILE_M, TILE_N)), Float32)\n",
             "        pipe_v.consumer_wait(v_state)\n",
             "        self.pv_gemm(tiled_mma_pv, acc_O, rP, tOrV[None, None, None, v_state.index], sums)\n",
             "        warpgroup.wait_group(1)\n",
             "        pipe_k.consumer_release(state)\n        self.modify(",
             "        warpgroup.wait_group(0)\n        pipe_v.consumer_release(v_state)\n",
             "        pipe_v.consumer_release(v_state)\n        self.to_p_operand",
             "        return state\n"]
    for event, text in enumerate(marks):
        sub(text, f"        self.trace(mLSE, trace_base, n_block, {event}, t0)\n" + text)
    sub("    @cute.jit\n    def to_p_operand(",
        "    @cute.jit\n    def trace(self, mLSE, trace_base, n_block, event: cutlass.Constexpr, t0):\n"
        "        if trace_base >= 0:\n"
        f"            mLSE[trace_base + n_block * {EVENTS} + event, 0, 0] = Float32(cute.arch.clock() - t0)\n\n"
        "    @cute.jit\n    def to_p_operand(")
    # the producer (one thread): its own base after the consumer warpgroups'; mLSE passed down through load_tile
    sub("                  q_state, kv_state, split, packed, scores):\n",
        "                  q_state, kv_state, split, packed, scores, mLSE):\n")
    sub("split, packed,\n                                                           scores)\n",
        "split, packed,\n                                                           scores, mLSE)\n")
    sub("pipe_q, pipe_k, pipe_v, q_state, kv_state, split, packed, scores)\n",
        "pipe_q, pipe_k, pipe_v, q_state, kv_state, split, packed, scores, mLSE)\n")
    sub("                                 packed, seqlen_k)\n", "                                 packed, seqlen_k, mLSE)\n")
    sub("n_block_min, n_block_max, packed, seqlen_k):\n", "n_block_min, n_block_max, packed, seqlen_k, mLSE):\n")
    loads = '        """One tile\'s TMA loads: Q, then K and V block by block; returns the K/V pipeline state after them."""\n'
    sub(loads, loads + _trace_start(trace_m, trace_h, "True", str(PRODUCER_BASE)))
    # (the leading newline: the dense loop's lines, not PAGED's more deeply indented ones)
    for text, event in (("\n            pipe_k.producer_acquire(kv_state)\n", 0),
                        ("\n            pipe_v.producer_acquire(kv_state)\n", 2)):
        sub(text, text + f"            self.trace(mLSE, trace_base, n_block, {event}, t0)\n")
    for text, event in (("tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))\n", 1),
                        ("tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))\n", 3)):
        sub(text, text + f"            self.trace(mLSE, trace_base, n_block, {event}, t0)\n")
    sub("                        mLSE[row, head, batch] = lse[r]\n", "                        pass  # the LSE tensor holds the trace\n")
    return source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="fp8", choices=("fp8", "16bit"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tile", default="128x128")
    p.add_argument("--warpgroups", type=int, default=2)
    p.add_argument("--stages", type=int, default=2, help="K/V pipeline stages")
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--trace-m", type=int, default=64, help="m block of the traced CTA")
    p.add_argument("--trace-head", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    tile_m, tile_n = map(int, args.tile.split("x"))
    tile = Sm90FwdTile(tile_m, tile_n, args.stages, **(WG2 if args.warpgroups == 2 else WG3))
    assert not check(tile, args.head_dim, args.kind), check(tile, args.head_dim, args.kind)
    source = Source.of(cc.TEMPLATE, tile.params(args.head_dim, args.kind), tile.module(args.head_dim, args.kind))
    folder = pathlib.Path(tempfile.mkdtemp(prefix="cute_sm90_timeline_"))
    path = folder / f"{source.name}_trace.py"
    path.write_text(patch(source.text(), args.trace_m, args.trace_head))
    cute.target(cc.ARCH)  # before the patched module imports cutlass
    mod = import_path(path, f"{source.name}_trace")
    fp8 = args.kind == "fp8"
    # the build gives dtype, causality, arch and the compile factory; the patched module is compiled in its place
    kernel = cute.compile_kernel(cc.cute_build(source, "fp8" if fp8 else "bf16", False), module=mod)

    n, d = args.seqlen, args.head_dim
    b, h = max(16384 // n, 1), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.full((b, h, n), float("nan"), device="cuda")
    scale_log2 = d ** -0.5 * math.log2(math.e)
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        run = lambda: kernel(q, k, prepare_v_fp8(v), out, lse, torch.ones(3, b, h, device="cuda"),  # noqa: E731
                             scale_log2, max_ctas(q.device))
    else:
        run = lambda: kernel(q, k, v, out, lse, scale_log2, max_ctas(q.device))  # noqa: E731
    for _ in range(3):  # the last run's trace is read
        run()
    torch.cuda.synchronize()
    trace = lse[0, 0].view(-1).cpu()
    blocks = n // tile_n - 1  # steps: n_block = blocks-1 ... 0 (the first block has no step)
    report = {"tile": tile.describe(), "kind": args.kind, "head_dim": d, "seqlen": n, "warpgroups": {}}
    for wg in range(tile.consumer_warpgroups):
        ev = trace[wg * SLOTS: wg * SLOTS + blocks * EVENTS].view(blocks, EVENTS)[:, :len(PHASES) + 1]
        ev = ev.flip(0)  # in execution order
        middle = ev[blocks // 8: blocks - blocks // 8]
        phases = {name: statistics.median((middle[:, i + 1] - middle[:, i]).tolist()) for i, name in enumerate(PHASES)}
        periods = (middle[1:, 0] - middle[:-1, 0]).tolist()
        phases["period"] = statistics.median(periods)
        report["warpgroups"][wg] = {"median_cycles": phases, "first_blocks": ev[:4].tolist(),
                                    "issue_times": ev[:, 1].tolist()}
        print(f"warpgroup {wg}: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    if tile.consumer_warpgroups > 1:
        e1 = [torch.tensor(report["warpgroups"][w]["issue_times"]) for w in range(tile.consumer_warpgroups)]
        lag = (e1[1] - e1[0])[blocks // 8: blocks - blocks // 8]
        print(f"warpgroup 1 issues {lag.median().item():.0f} cycles after warpgroup 0 (median)")
    # the producer, per block in load order (its first block has no step), beside the consumers' events
    prod = trace[PRODUCER_BASE: PRODUCER_BASE + (blocks + 1) * EVENTS].view(blocks + 1, EVENTS)[:, :len(PRODUCER)].flip(0)
    report["producer"] = prod.tolist()
    print("absolute cycles, four middle blocks (producer: block j's K and V loads; consumers: step j, whose S uses block j+1's K and P V block j's V)")
    for j in range(blocks // 2, blocks // 2 + 4):
        print(f"  block {j}: producer " + " ".join(f"{name} {prod[j, i]:.0f}" for i, name in enumerate(PRODUCER)))
        for wg in range(tile.consumer_warpgroups):
            ev = trace[wg * SLOTS: wg * SLOTS + blocks * EVENTS].view(blocks, EVENTS).flip(0)
            print(f"    warpgroup {wg}: " + " ".join(f"{v:.0f}" for v in ev[j, :len(PHASES) + 1].tolist()))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Splitting a part-filled last wave (TAIL_SPLIT in the cute_sm90 template).

A kernel with one CTA per tile runs ceil(tiles / SMs) waves of equal tiles; when the last wave is part-filled,
most SMs idle through it (wave quantization). With tail splitting, the tiles of that last wave run as P pieces
each, piece p taking key blocks [p n / P, (p + 1) n / P) of the tile's n, so the wave ends sooner; each piece
writes its normalised output and LSE (fp32) into a workspace, and a small Triton kernel merges a tile's pieces:
lse = log sum_p exp(lse_p), out = sum_p exp(lse_p - lse) out_p. Exact up to fp32 rounding, like the online
softmax across key blocks it continues. FlashDecoding's split-KV, used on the tail only, like CUTLASS's
"data-parallel + stream-K" GEMM schedules.

Measured on the H200 (benchmarks/results/2026-11-29-h200-cute_sm90-tail_split/, summarised in docs/performance.md), the FP8 d=128 kernel
(192-row tiles): without splitting, 965-973 TFLOP/s at exactly 7 waves of tiles (B=1, H=11, N=16128) against
889-890 at 7.17 waves (N=16384), so the part-filled eighth wave cost ~0.7 of a full one (the clock rises while
few SMs draw power). With the split, at the benchmarks' B=1, H=16, N=16384 (56 tail tiles as 2 pieces each):
929 against 903 TFLOP/s, medians of 9 interleaved rounds; 933-942 against 877-904 in three other runs. At
N=4096 (88 tail tiles of 43 key blocks) the plan keeps tiles whole, and forced pieces measured no faster
(2: 799-813, 3: 836-852, whole 837-855).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

MAX_PIECES = 8
MIN_BLOCKS_PER_PIECE = 4  # so a piece's fixed costs (Q load, pipeline fill, fp32 store) stay small against its loop
# A piece's fixed cost beyond its key blocks, in key-block times: the Q load and pipeline fill, its fp32 store and
# its share of the combine (an estimate; the plan only needs to rank the choices).
PIECE_OVERHEAD_BLOCKS = 2
MAX_PIECE_WAVES = 2  # bounds the workspace: at most 2 x SMs pieces
MIN_GAIN = 0.03  # split only when the estimated time drops by more than this fraction


@dataclasses.dataclass(frozen=True)
class Plan:
    """Tiles [0, full_tiles) run whole; each of the tail_tiles after them runs as ``pieces`` pieces."""

    full_tiles: int
    tail_tiles: int
    pieces: int

    @property
    def slots(self) -> int:
        return self.tail_tiles * self.pieces

    def check(self, tiles: int, key_blocks: int) -> list[str]:
        """Reasons the plan cannot run ``tiles`` tiles of ``key_blocks`` key blocks each (empty: it can)."""
        reasons = []
        if self.full_tiles + self.tail_tiles != tiles or min(self.full_tiles, self.tail_tiles) < 0:
            reasons.append(f"full_tiles {self.full_tiles} + tail_tiles {self.tail_tiles} != {tiles} tiles")
        if not 1 <= self.pieces <= key_blocks:
            reasons.append(f"{self.pieces} pieces per tile for {key_blocks} key blocks: each needs at least one")
        return reasons


def counts(tile, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(tiles, key blocks per tile) of a call to a kernel of ``tile`` (a variants.Sm90FwdTile)."""
    return -(-seqlen_q // tile.tile_m) * heads * batch, -(-seqlen_k // tile.tile_n)


def whole(tiles: int) -> Plan:
    """Every tile in one CTA (no pieces)."""
    return Plan(tiles, 0, 1)


def estimate(plan: Plan, key_blocks: int, sms: int) -> float:
    """Time in key-block times: whole tiles in waves, then the pieces in waves of SMs."""
    whole_waves = plan.full_tiles / sms if plan.tail_tiles else math.ceil(plan.full_tiles / sms)
    time = whole_waves * key_blocks
    if plan.tail_tiles:
        per_piece = math.ceil(key_blocks / plan.pieces) + (PIECE_OVERHEAD_BLOCKS if plan.pieces > 1 else 0)
        time += math.ceil(plan.slots / sms) * per_piece
    return time


@functools.lru_cache(maxsize=1024)
def plan(tiles: int, key_blocks: int, sms: int) -> Plan:
    """The plan for ``tiles`` equal tiles of ``key_blocks`` key blocks on ``sms`` SMs (one CTA each): the
    last, part-filled wave split into the piece count that estimate() finds fastest, when that saves more
    than MIN_GAIN; else whole tiles."""
    full_waves, tail = divmod(tiles, sms)
    base = whole(tiles)
    if tail == 0:
        return base
    best, best_time = base, estimate(base, key_blocks, sms)
    for pieces in range(2, MAX_PIECES + 1):
        if key_blocks // pieces < MIN_BLOCKS_PER_PIECE or math.ceil(tail * pieces / sms) > MAX_PIECE_WAVES:
            break
        candidate = Plan(full_waves * sms, tail, pieces)
        time = estimate(candidate, key_blocks, sms)
        if time < best_time:
            best, best_time = candidate, time
    return best if best_time < (1 - MIN_GAIN) * estimate(base, key_blocks, sms) else base


@functools.lru_cache(maxsize=16)
def _unused_workspaces(tile_m: int, head_dim: int, device: torch.device):
    """One-slot workspaces for calls that split nothing (the kernel takes them and writes none)."""
    return (torch.empty(1, tile_m, head_dim, device=device), torch.empty(1, tile_m, device=device))


def workspaces(p: Plan, tile_m: int, head_dim: int, device: torch.device):
    """(outputs, LSEs) for the plan's pieces: fp32 (slots, tile_m, head_dim) and (slots, tile_m)."""
    if not p.slots:
        return _unused_workspaces(tile_m, head_dim, device)
    return (torch.empty(p.slots, tile_m, head_dim, device=device), torch.empty(p.slots, tile_m, device=device))


def combine(p: Plan, o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            tile_m: int) -> None:
    """Merge the pieces of the plan's tail tiles into out (batch, heads, seqlen_q, head_dim) and lse (batch,
    heads, seqlen_q), both with unit stride on their last dimension."""
    from ...runtime.triton_launch import launch
    from . import tail_split_kernel as k

    if out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError(f"combine needs unit stride on the last dimension (out {out.stride()}, lse {lse.stride()})")
    b, h, n, d = out.shape
    grid = (p.tail_tiles, -(-tile_m // k.BLOCK_ROWS))
    args = (o_part, lse_part, out, lse, p.full_tiles, p.pieces, -(-n // tile_m), h, n,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    # (no `attnforge build` entry: launch() finds no prebuilt kernel for it and uses Triton's JIT)
    launch(k.combine_pieces, grid, args, dict(TILE_M=tile_m, HEAD_DIM=d, BLOCK_ROWS=k.BLOCK_ROWS), k.NUM_WARPS, 1)

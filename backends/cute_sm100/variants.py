"""The cute_sm100 variant table: tile configs per head dim and the ONE validity check (shared memory,
tensor memory, shapes) that supports(), codegen and `attnforge build` use.

Where the numbers come from: FlashAttention-4's 128-row Q tiles and 128-key blocks on sm100
(flash_fwd_sm100.py; docs/kernel-notes.md section 11), with one Q tile per CTA
instead of two; tensor memory: 128 lanes x 512 32-bit columns per CTA, allocated in powers of two
>= 32 columns (same notes). None of it is measured: there is no Blackwell GPU to run it on.
"""

from __future__ import annotations

import dataclasses

from ...dispatch.variant import first_that_fits

HEAD_DIMS = (64, 128)
SMEM_BYTES = 232448  # 227 KiB per block, as sm90
TMEM_COLUMNS = 512
ELEMENT_BYTES = 2  # fp16 / bf16


@dataclasses.dataclass(frozen=True)
class Sm100FwdTile:
    """One forward kernel configuration (128 query rows: one tcgen05 M block, one softmax warpgroup)."""

    tile_m: int = 128
    tile_n: int = 128
    kv_stages: int = 2
    # Register spill (ptxas stack bytes) accepted: the kernel compiles at the 255-register cap with this
    # much spilled (CuTe DSL 4.8.1); it has never run, so this is a compile fact, not a speed trade.
    accepted_spill_bytes: int = 0

    def module(self, head_dim: int) -> str:
        return f"fwd_16bit_d{head_dim}_m{self.tile_m}_n{self.tile_n}_s{self.kv_stages}"

    def tmem_columns(self, head_dim: int) -> int:
        needed = self.tile_n + head_dim  # S, then O, fp32
        return max(32, 1 << (needed - 1).bit_length())

    def params(self, head_dim: int, window: bool = False, softcap: bool = False, sinks: bool = False,
               alibi: bool = False, varlen: bool = False) -> dict:
        """The template's parameters; ``window``, ``softcap``, ``sinks``, ``alibi`` and ``varlen`` compile in its
        WINDOW, SOFTCAP, SINKS, ALIBI and VARLEN."""
        return {**dataclasses.asdict(self), "head_dim": head_dim, "tmem_columns": self.tmem_columns(head_dim),
                "window": window, "softcap": softcap, "sinks": sinks, "alibi": alibi, "varlen": varlen}

    def smem_bytes(self, head_dim: int) -> int:
        tiles = self.tile_m * head_dim + 2 * self.kv_stages * self.tile_n * head_dim + self.tile_m * self.tile_n  # Q, K/V, P
        return ELEMENT_BYTES * tiles + 8 * (6 + 4 * self.kv_stages) + 1024

    def describe(self) -> str:
        return f"{self.tile_m}x{self.tile_n} s{self.kv_stages} tcgen05, S/O in TMEM"


def check(tile: Sm100FwdTile, head_dim: int) -> list[str]:
    """The one validity check: reasons ``tile`` cannot serve ``head_dim`` (empty: it can)."""
    reasons = []
    name = tile.describe()
    if head_dim not in HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} has no cute_sm100 kernel (has {', '.join(map(str, HEAD_DIMS))})")
    if tile.tile_m != 128:
        reasons.append(f"{name}: tile_m must be 128 (one tcgen05 M block read by one softmax warpgroup)")
    if tile.tile_n % 32 or not 32 <= tile.tile_n <= 256:
        reasons.append(f"{name}: tile_n must be a multiple of 32 in [32, 256] (32-column TMEM loads; MMA N <= 256)")
    if tile.kv_stages < 1:
        reasons.append(f"{name}: needs at least one K/V stage")
    if tile.tmem_columns(head_dim) > TMEM_COLUMNS:
        reasons.append(f"{name} at head_dim {head_dim} needs {tile.tmem_columns(head_dim)} tensor-memory columns, "
                       f"a CTA has {TMEM_COLUMNS}")
    if tile.smem_bytes(head_dim) > SMEM_BYTES:
        reasons.append(f"{name} at head_dim {head_dim} needs {tile.smem_bytes(head_dim) // 1024} KiB of shared memory, "
                       f"sm100 has {SMEM_BYTES // 1024} KiB")
    return reasons


FWD: dict[int, list[Sm100FwdTile]] = {
    64: [Sm100FwdTile(128, 128, 2, accepted_spill_bytes=104)],
    128: [Sm100FwdTile(128, 128, 2, accepted_spill_bytes=104)],
}


def pick(head_dim: int) -> tuple[Sm100FwdTile | None, list[str]]:
    candidates = FWD.get(head_dim)
    if not candidates:
        return None, [f"head_dim {head_dim} has no cute_sm100 kernel (has {', '.join(map(str, HEAD_DIMS))})"]
    return first_that_fits(candidates, lambda tile: check(tile, head_dim))


def picks() -> list[tuple[int, Sm100FwdTile]]:
    return [(d, t) for d in HEAD_DIMS for t, _ in [pick(d)] if t is not None]

"""The triton_fa2 variant table: tile configs per arch and head dim, and the ONE validity check
that supports(), the heuristic that picks a variant, codegen and the autotuner all use.

Where the numbers come from (docs/kernel-notes.md, sections 2-4):
- shared memory: Triton 3.9's pointer kernel at d=128 measured Q + (stages-1) x (K + V) tiles plus
  ~8 KiB of layout scratch (64x64 s2: 56 KiB, 128x64 s2: 64 KiB, 128x64 s3: 96 KiB, 128x128 s2: 96 KiB);
- tiles: FlashAttention-2's CUDA launch templates (sm80 d64 128x128, d128 128x64; sm86/89 64x64
  for d128; d256 64x64 where shared memory is short), the H200 probe in those notes (d64 128x64 w8
  s3, d128 128x64/128x128 w8), and spill checks there (d128 128x64 needs 8 warps, not 4).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from ...dispatch.variant import first_that_fits
from ...runtime.cache import default_cache_dir

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# The Triton release the spill-free claims below were checked with (compile sweeps); register
# allocation shifts between releases (on 3.6, sm80 d32/d256 and sm89 d32 picks spill a little).
SPILL_CHECKED_WITH = "3.9"  # non-powers of two are padded to the next power inside the kernel
ELEMENT_BYTES = 2  # fp16 / bf16
# Register estimate of the tiles alone (accumulators, operands, scores) per thread; past the
# hardware's 255 a config spills for sure. Below it spills still happen (the compile checks look).
REGISTERS_PER_THREAD = 255
LAYOUT_SCRATCH = 8 * 1024

# Opt-in shared memory per block (bytes) of the archs the Triton backends have tables for; on AMD the
# LDS per workgroup (64 KiB on CDNA2/3, 160 KiB on CDNA4; docs/kernel-notes.md, section 3).
SMEM = {"sm80": 166912, "sm86": 101376, "sm89": 101376, "sm90": 232448, "sm100": 232448, "sm120": 101376,
        "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}
NO_TMA = ("sm80", "sm86", "sm89", "gfx90a", "gfx942", "gfx950")


def warp_size(arch: str) -> int:
    return 64 if arch.startswith("gfx") else 32  # CDNA wavefronts are 64 lanes


def register_budget(arch: str) -> int:
    # NVIDIA: 255 per thread. CDNA2/3: 256 arch VGPRs + 256 AccVGPRs per lane (512) at occupancy 1.
    return 512 if arch.startswith("gfx") else REGISTERS_PER_THREAD


def padded(head_dim: int) -> int:
    return 1 << (head_dim - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class FwdTile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    loads: str = "pointer"  # or "descriptor" (TMA on sm90+)

    @property
    def module(self) -> str:
        loads = {"pointer": "ptr", "descriptor": "desc"}[self.loads]
        return f"fwd_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}_{loads}"

    def params(self) -> dict:
        return dataclasses.asdict(self)

    def smem_bytes(self, head_dim: int, arch: str = "sm80") -> int:
        d = padded(head_dim)
        if arch.startswith("gfx"):  # AMD, Triton 3.9: one K tile per stage in LDS (64x64 s1 at d=128: 16 KiB)
            return ELEMENT_BYTES * d * self.block_n * self.num_stages
        return ELEMENT_BYTES * (self.block_m * d + max(self.num_stages - 1, 1) * 2 * self.block_n * d) + LAYOUT_SCRATCH

    def registers(self, head_dim: int, lanes: int = 32) -> int:
        d = padded(head_dim)  # fp32 accumulator + 16-bit q (two per register) + fp32 scores
        return (self.block_m * d + self.block_m * d // 2 + self.block_m * self.block_n) // (lanes * self.num_warps)

    def describe(self) -> str:
        return f"fwd {self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages} {self.loads}"


@dataclasses.dataclass(frozen=True)
class BwdTile:
    block_m1: int  # queries per step, dK/dV kernel
    block_n1: int  # keys per program, dK/dV kernel
    block_m2: int  # queries per program, dQ kernel
    block_n2: int  # keys per step, dQ kernel
    num_warps: int
    num_stages: int

    @property
    def module(self) -> str:
        return (f"bwd_m{self.block_m1}_n{self.block_n1}_m{self.block_m2}_n{self.block_n2}"
                f"_w{self.num_warps}_s{self.num_stages}")

    def params(self) -> dict:
        return dataclasses.asdict(self)

    def smem_bytes(self, head_dim: int, arch: str = "sm80") -> int:
        d, stages = padded(head_dim), max(self.num_stages - 1, 1)
        if arch.startswith("gfx"):  # AMD, Triton 3.9: the larger resident tile per stage (gfx942 measurements)
            return ELEMENT_BYTES * d * max(self.block_n1, self.block_m2) * self.num_stages
        dkdv = self.block_n1 * d * 2 + stages * 2 * self.block_m1 * d  # k, v resident; q, dO streamed
        dq = self.block_m2 * d * 2 + stages * 2 * self.block_n2 * d  # q, dO resident; k, v streamed
        return ELEMENT_BYTES * max(dkdv, dq) + LAYOUT_SCRATCH

    def registers(self, head_dim: int, lanes: int = 32) -> int:
        d = padded(head_dim)  # dK/dV: two fp32 accumulators + k, v + P/dS; dQ: one accumulator + q, dO + P/dS
        dkdv = 2 * self.block_n1 * d + self.block_n1 * d + self.block_n1 * self.block_m1
        dq = self.block_m2 * d + self.block_m2 * d + self.block_m2 * self.block_n2
        return max(dkdv, dq) // (lanes * self.num_warps)

    def describe(self) -> str:
        return (f"bwd dkdv {self.block_n1}x{self.block_m1} dq {self.block_m2}x{self.block_n2} "
                f"w{self.num_warps} s{self.num_stages}")


@dataclasses.dataclass(frozen=True)
class KVTile:
    """A tile of the KV-cache kernel (templates/triton_kvcache.py.jinja): ``block_m`` packed (query, head) rows
    (pack-GQA), ``block_n`` keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # PAGE_LOOKAHEAD in the template: a paged cache's block-table entries are read one key step ahead of the K and V
    # loads that use them, so the software pipeline issues those loads without waiting for a block-table read (a
    # template option no table tile takes: on an H100 it moved paged decode by -3% to +7%, +0.1% at batch 1;
    # benchmarks/results/2026-12-08-h100-paged-lookahead/, benchmarks/run_paged_lookahead.sh)
    lookahead: bool = False

    @property
    def module(self) -> str:
        return (f"kvcache_m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
                + ("_la" if self.lookahead else ""))

    def params(self) -> dict:
        return dataclasses.asdict(self)

    def smem_bytes(self, head_dim: int, arch: str = "sm80") -> int:
        # K and V tiles per pipelined stage (q stays in registers), and with lookahead the block-table entries the
        # pipeline stages beside them (int32, one per key row)
        stages = max(self.num_stages - 1, 1)
        entries = stages * self.block_n * 4 if self.lookahead else 0
        return ELEMENT_BYTES * stages * 2 * self.block_n * padded(head_dim) + entries + LAYOUT_SCRATCH

    def registers(self, head_dim: int, lanes: int = 32) -> int:
        d = padded(head_dim)  # fp32 accumulator + 16-bit q + fp32 scores + the K and V tiles being loaded
        return (self.block_m * d + self.block_m * d // 2 + self.block_m * self.block_n
                + self.block_n * d) // (lanes * self.num_warps)

    def describe(self) -> str:
        return (f"kvcache {self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
                + (" lookahead" if self.lookahead else ""))


def check(tile: FwdTile | BwdTile | KVTile, arch: str, head_dim: int) -> list[str]:
    """The one validity check: reasons ``tile`` cannot serve ``head_dim`` on ``arch`` (empty: it can)."""
    reasons = []
    blocks = ((tile.block_m1, tile.block_n1, tile.block_m2, tile.block_n2) if isinstance(tile, BwdTile)
              else (tile.block_m, tile.block_n))
    if any(b < 16 or b & (b - 1) for b in blocks):
        reasons.append(f"{tile.describe()}: tile sides must be powers of two >= 16 (tensor-core shapes)")
    if arch not in SMEM:
        reasons.append(f"no shared-memory figure for {arch}")
    elif tile.smem_bytes(head_dim, arch) > SMEM[arch]:
        reasons.append(f"{tile.describe()} at head_dim {head_dim} needs ~{tile.smem_bytes(head_dim, arch) // 1024} KiB of "
                       f"shared memory, {arch} has {SMEM[arch] // 1024} KiB")
    registers, budget = tile.registers(head_dim, warp_size(arch)), register_budget(arch)
    if registers > budget:
        reasons.append(f"{tile.describe()} at head_dim {head_dim} needs ~{registers} registers per "
                       f"thread for its tiles (budget {budget})")
    if isinstance(tile, FwdTile) and tile.loads == "descriptor" and arch in NO_TMA:
        reasons.append("descriptor loads need TMA (NVIDIA sm90+)")
    return reasons


def _f(m, n, w, s, loads="pointer"):
    return FwdTile(m, n, w, s, loads)


# sm80/sm86/sm89/sm120 (pointer loads): the tiles of FlashAttention-2's launch templates spill in
# this kernel under Triton 3.9 (compile sweep, 2026-11-29: at d=128, 128x64 w4 spills 7 KiB, 128x64
# w8 256 B, 64x64 w4 16 B); these are the largest spill-free ones, 8 warps throughout.
_AMPERE_100K_FWD = {  # sm86/sm89/sm120: ~99 KiB of shared memory
    32: [_f(128, 64, 8, 2)], 64: [_f(64, 64, 8, 2)], 96: [_f(64, 64, 8, 2)], 128: [_f(64, 64, 8, 2)],
    192: [_f(32, 32, 8, 1)], 256: [_f(32, 32, 8, 1)],  # sm89: every 64-row tile spills 16-32 B here
}
# sm90/sm100: 227 KiB, tensor descriptors lowered to TMA. d64/d128: the H200 sweep of 2026-11-29
# (benchmarks/results/2026-11-29-h200-triton_fa2/sweep.json): 128x64 w8 s3 descriptor was fastest or
# within 3% of it at N=4k/16k, causal and not (d128: 472-508 TFLOP/s non-causal).
_HOPPER_FWD = {
    32: [_f(128, 64, 4, 3, "descriptor")], 64: [_f(128, 64, 8, 3, "descriptor")],
    96: [_f(128, 64, 8, 3, "descriptor")], 128: [_f(128, 64, 8, 3, "descriptor")],
    192: [_f(64, 64, 8, 2, "descriptor")], 256: [_f(64, 64, 8, 2, "descriptor")],
}
# sm80 d=256: 64x64 spilled 112 B once masked tiles zero the values of non-finite keys (the forward template's
# _tile); 64x32, as at d=192, compiles spill-free (Triton 3.9 compile check, 2026-12-02). Not timed: no sm80 GPU.
FWD: dict[str, dict[int, list[FwdTile]]] = {
    "sm80": {32: [_f(128, 64, 8, 2)], 64: [_f(128, 64, 8, 3)], 96: [_f(64, 64, 8, 2)], 128: [_f(64, 64, 8, 2)],
             192: [_f(64, 32, 8, 2)], 256: [_f(64, 32, 8, 2)]},
    "sm86": _AMPERE_100K_FWD, "sm89": _AMPERE_100K_FWD, "sm120": _AMPERE_100K_FWD,
    "sm90": _HOPPER_FWD, "sm100": _HOPPER_FWD,
}

# sm90 d64/d128 from the same sweep: d128 dK/dV 128 keys x 64 queries, dQ 128x64, w8 s3 (389-401
# TFLOP/s, backward = 2.5x forward FLOPs); d64 64x64 w4 s3 (297-331). d192/256 not measured yet.
_HOPPER_BWD = {  # sm90/sm100
    32: [BwdTile(64, 64, 64, 64, 4, 3)], 64: [BwdTile(64, 64, 64, 64, 4, 3)],
    96: [BwdTile(64, 128, 128, 64, 8, 3)], 128: [BwdTile(64, 128, 128, 64, 8, 3)],
    192: [BwdTile(32, 32, 32, 32, 8, 2)], 256: [BwdTile(32, 32, 32, 32, 8, 2)],
}
# sm80/sm86/sm89/sm120: the largest tiles whose dK/dV and dQ kernels compile spill-free for sm80
# under Triton 3.9 (compile sweep, 2026-11-29; every 64-key dK/dV tile spilled at d >= 64, up to 7 KiB).
# Not yet timed on an Ampere/Ada GPU.
_AMPERE_BWD = {
    32: [BwdTile(32, 64, 64, 32, 4, 2)], 64: [BwdTile(32, 32, 32, 32, 8, 1)],
    96: [BwdTile(32, 32, 32, 32, 8, 1)], 128: [BwdTile(32, 32, 32, 32, 8, 1)],
    192: [BwdTile(16, 32, 32, 16, 8, 1)], 256: [BwdTile(16, 32, 32, 16, 8, 1)],
}
# sm86/sm89/sm120 at d=32: the 2-stage tile's dK/dV kernel spills 8 B for sm89 once compiled as Triton's JIT compiles a
# call (row strides multiples of 16, runtime.triton_aot); its 1-stage form does not (compile sweep, Triton 3.9,
# 2026-12-07). Not timed.
_AMPERE_100K_BWD = {**_AMPERE_BWD, 32: [BwdTile(32, 64, 64, 32, 4, 1)]}
BWD: dict[str, dict[int, list[BwdTile]]] = {
    "sm80": _AMPERE_BWD, "sm86": _AMPERE_100K_BWD, "sm89": _AMPERE_100K_BWD, "sm120": _AMPERE_100K_BWD,
    "sm90": _HOPPER_BWD, "sm100": _HOPPER_BWD,
}


# The KV-cache kernel (decode and chunked prefill). block_m here is the most packed rows a tile takes: a call with
# fewer rows (seqlen_q x query heads per KV head) takes the smallest power of two >= 16 that holds them
# (kv_tile). Decode is bound by reading K and V: on the H200 (benchmarks/bench_kvcache.py --sweep, 2026-12-01,
# benchmarks/results/2026-12-01-h200-kvcache/) 128-key steps, 3 stages were fastest at d=128 (4.47-4.51 TB/s of KV,
# w8 and w4 within 0.3%), 32-key steps 5-15% slower. Triton 3.9 spills these tiles 80-760 B at d=128 (its 2-D
# pointer tensors), which the measured speed includes; d192/d256 take the least-spilling 32x32 tile (compile
# sweep), not timed yet.
# sm80-sm89/sm120 (not timed yet) take 64-key steps in 2 stages: their smaller shared memory and register file.
_KV_WIDE = {192: [KVTile(32, 32, 4, 2)], 256: [KVTile(32, 32, 4, 2)]}
_HOPPER_KV = {d: [KVTile(64, 128, 8, 3)] for d in HEAD_DIMS if d <= 128} | _KV_WIDE
_AMPERE_KV = {d: [KVTile(64, 64, 4, 2)] for d in HEAD_DIMS if d <= 128} | _KV_WIDE
KVCACHE: dict[str, dict[int, list[KVTile]]] = {arch: _HOPPER_KV if arch in ("sm90", "sm100") else _AMPERE_KV
                                               for arch in FWD}
# Paged caches (same sweep, pages of 64, d=128): 128-key steps in 4 warps, 2 stages, with many CTAs in flight were
# fastest: 4096 CTAs on 132 SMs (8 splits at batch 64 / 8k, 32 at batch 16 / 32k) ran 1.08x the contiguous time,
# where one split per (sequence, KV head) took 1.9x at batch 16: the block-table load ahead of each key row's load
# wants latency hidden by more CTAs, so paged calls split up to PAGED_CTAS_PER_MULTIPROCESSOR per multiprocessor.
_HOPPER_KV_PAGED = {d: [KVTile(64, 128, 4, 2)] for d in HEAD_DIMS if d <= 128} | _KV_WIDE
KVCACHE_PAGED: dict[str, dict[int, list[KVTile]]] = {arch: _HOPPER_KV_PAGED if arch in ("sm90", "sm100") else _AMPERE_KV
                                                     for arch in FWD}
PAGED_CTAS_PER_MULTIPROCESSOR = 32
# Split-KV: a call whose batch x KV heads x row tiles fills at least SPLIT_BELOW_FILL of the multiprocessors runs
# unsplit (contiguous; same H200 sweep: 128 tiles on 132 SMs ran 2% faster unsplit than in 2 splits) or splits
# towards PAGED_CTAS_PER_MULTIPROCESSOR (paged). A call with fewer tiles splits into the largest power of two that
# keeps its CTAs within one wave, as many CTAs per multiprocessor as the tile's shared memory lets run at once
# (kv_ctas_per_multiprocessor: at d=128 on sm90 one for the contiguous tile, whose 3 stages of 128-key K and V take
# 128 KB, three for the paged one's 2 stages). Each split takes at least MIN_KEY_BLOCKS_PER_SPLIT key steps (paged:
# MIN_KEY_BLOCKS_PER_SPLIT_PAGED), since a split's fixed cost, its partial's write and the combine, is paid once per
# split. Measured on an H100 (benchmarks/decode_floor.py --batch B --paged, per layer, 8k keys, GQA 32/8, d=128;
# benchmarks/results/2026-12-07-h100-decode-splits/): the rule picks the fastest split count measured at batch 1, 2,
# 4, 8 and 12, contiguous and paged, where rounding up to fill every SM (the rule before) left a second, partial
# wave: batch 4 contiguous 59.5 us in 5 splits against 50.3 in 4. Other head dims and archs follow the same rule,
# untimed.
SPLIT_BELOW_FILL = 0.75
MAX_SPLITS = 128
MIN_KEY_BLOCKS_PER_SPLIT = 4
MIN_KEY_BLOCKS_PER_SPLIT_PAGED = 2


# The KV-cache kernel's head dims: every multiple of 8 from 16 to 256. One between the table's head dims takes the tile
# of the next one up, its columns past head_dim masked (D < HEAD_DIM in the template, as 96 and 192 have always run,
# on the GPU too): decode reads only the real columns, so the padding costs arithmetic, not bandwidth. (The attention
# kernels keep HEAD_DIMS: there a padded head dim is padded work, and SDPA serves the others.)
KV_HEAD_DIMS = tuple(range(16, 257, 8))


def kv_table_dim(table_dims, head_dim: int) -> int | None:
    """The head dim of the KV-cache table entry that serves ``head_dim``: the first of ``table_dims`` at least as
    large (None past them, or for a head dim outside KV_HEAD_DIMS)."""
    if head_dim not in KV_HEAD_DIMS:
        return None
    return next((d for d in sorted(table_dims) if d >= head_dim), None)


def kv_tile(table: dict, arch: str, head_dim: int, rows: int) -> tuple[KVTile | None, list[str]]:
    """The KV-cache tile for ``rows`` packed (query, head) rows: the first of the table's tiles (those of
    kv_table_dim's entry) that passes check() with block_m cut to the smallest power of two >= max(rows, 16) where
    that is smaller, and halved (to 16 at least) until it does; with the reasons when none does."""
    if arch not in table:
        return None, [f"no KV-cache tiles for {arch} (has {', '.join(table)})"]
    candidates = table[arch].get(kv_table_dim(table[arch], head_dim))
    if not candidates:
        return None, [f"head_dim {head_dim} has no KV-cache tile (has every multiple of 8 from 16 to "
                      f"{max(table[arch])})"]
    want = max(16, 1 << max(rows - 1, 0).bit_length())
    reasons = []
    for tile in candidates:
        tile = dataclasses.replace(tile, block_m=min(tile.block_m, want))
        while True:
            why = check(tile, arch, head_dim)
            if not why:
                return tile, []
            if tile.block_m <= 16:
                reasons += why
                break
            tile = dataclasses.replace(tile, block_m=tile.block_m // 2)
    return None, reasons


@functools.lru_cache(maxsize=None)
def kv_ctas_per_multiprocessor(tile: KVTile, arch: str, head_dim: int) -> int:
    """How many CTAs of KV-cache ``tile`` a multiprocessor of ``arch`` runs at once, as its shared memory allows (at
    least one)."""
    return max(SMEM.get(arch, 0) // tile.smem_bytes(head_dim, arch), 1)


def kv_splits(ctas: int, longest: int, block_n: int, multiprocessors: int, asked: int = 0,
              paged: bool = False, ctas_per_multiprocessor: int = 1) -> tuple[int, int]:
    """(splits, keys per split) for ``ctas`` tiles over caches of at most ``longest`` keys: ``asked`` splits when
    > 0 (flash-attn's num_splits; at most MAX_SPLITS), else the heuristic above (``paged``: its paged form;
    ``ctas_per_multiprocessor``: what kv_ctas_per_multiprocessor says of the tile). Keys per split is a multiple of
    block_n and the splits cover ``longest`` (the last may be short; never more splits than key steps)."""
    steps = max(-(-longest // block_n), 1)
    fills = ctas >= SPLIT_BELOW_FILL * multiprocessors
    if asked > 0:
        splits = min(asked, MAX_SPLITS)  # (flash-attn caps num_splits at 128 too)
    elif fills and not paged:
        splits = 1
    elif fills:
        target = PAGED_CTAS_PER_MULTIPROCESSOR * multiprocessors
        splits = min(-(-target // ctas), max(steps // MIN_KEY_BLOCKS_PER_SPLIT, 1), MAX_SPLITS)
    else:
        wave = ctas_per_multiprocessor * multiprocessors
        fewest_steps = MIN_KEY_BLOCKS_PER_SPLIT_PAGED if paged else MIN_KEY_BLOCKS_PER_SPLIT
        most = max(min(wave // max(ctas, 1), steps // fewest_steps, MAX_SPLITS), 1)
        splits = 1 << (most.bit_length() - 1)  # the largest power of two <= most
    per_split = -(-steps // min(splits, steps)) * block_n
    return -(-max(longest, 1) // per_split), per_split


def winners_path(arch: str, cache_dir=None) -> pathlib.Path:
    """Where `attnforge tune` keeps its winners for ``arch``."""
    return pathlib.Path(cache_dir or default_cache_dir()) / f"triton_fa2-tuned-{arch}.json"


@functools.lru_cache(maxsize=None)
def _tuned(arch: str) -> dict:
    """Winners `attnforge tune` persisted for this arch ({} when it never ran here, or the file is not a
    JSON object: it is data, and a bad one means no winners)."""
    try:
        data = json.loads(winners_path(arch).read_text())
    except (OSError, ValueError):  # OSError: also a bad ATTNFORGE_CACHE_DIR (runtime.cache.CacheError)
        return {}
    return data if isinstance(data, dict) else {}


def clear_tuned() -> None:
    _tuned.cache_clear()


def _valid_tile_params(cls, params) -> bool:
    """Whether ``params`` are exactly the fields of ``cls`` with values its methods can compute with."""
    fields = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(params, dict) or not set(fields) - {"loads"} <= set(params) <= fields:
        return False
    for name, value in params.items():
        if name == "loads":
            if value not in ("pointer", "descriptor"):
                return False
        elif type(value) is not int or value < 1 or (name == "num_warps" and value & (value - 1)):
            return False
    return True


def tuned_tile(family: str, arch: str, head_dim: int) -> FwdTile | BwdTile | None:
    """The persisted winner for (family, arch, head_dim), or None (none, or one of another shape: written
    by another version of this table, or not by `attnforge tune` at all)."""
    table = _tuned(arch).get(family)
    params = table.get(str(head_dim)) if isinstance(table, dict) else None
    cls = FwdTile if family == "fwd" else BwdTile
    if not _valid_tile_params(cls, params):
        return None
    return cls(**params)


def pick(table: dict, arch: str, head_dim: int, tuned: bool = True,
         backend: str = "triton_fa2") -> tuple[FwdTile | BwdTile | None, list[str]]:
    """The tile for (arch, head_dim): a winner `attnforge tune` persisted (triton_fa2's tables), if it
    passes check(); else the first tile of the table's list that passes check(),
    with the reasons none did (when none did)."""
    if tuned and (table is FWD or table is BWD):
        winner = tuned_tile("fwd" if table is FWD else "bwd", arch, head_dim)
        if winner is not None and not check(winner, arch, head_dim):
            return winner, []
    if arch not in table:
        return None, [f"no {backend} tiles for {arch} (has {', '.join(table)})"]
    candidates = table[arch].get(head_dim)
    if not candidates:
        return None, [f"head_dim {head_dim} has no {backend} variant (has {', '.join(map(str, HEAD_DIMS))})"]
    return first_that_fits(candidates, lambda tile: check(tile, arch, head_dim))


def tiles_of(table: dict) -> list:
    """Every tile a table's heuristic can pick on some arch and head dim, sorted by module name."""
    out = {}
    for arch in table:
        for head_dim in HEAD_DIMS:
            tile, _ = pick(table, arch, head_dim, tuned=False)
            if tile is not None:
                out[tile.module] = tile
    return sorted(out.values(), key=lambda t: t.module)


def all_tiles() -> tuple[list[FwdTile], list[BwdTile]]:
    """Every tile triton_fa2's heuristic can pick: what codegen renders."""
    return tiles_of(FWD), tiles_of(BWD)

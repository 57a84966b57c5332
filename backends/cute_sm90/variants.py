"""The cute_sm90 variant table: tile configs per input kind and head dim, and the ONE validity check
that supports(), the heuristic, codegen and `attnforge build` use.

Where the numbers come from:
- tiles: FlashAttention-3's sm90 tile table (hopper/tile_size.h; docs/kernel-notes.md section 10) as the
  starting point, then the H200 runs in benchmarks/results/ (each entry cites its data file; folders are
  abbreviated by what follows "2026-11-29-h200-cute_sm90-" or "2026-11-30-h200-cute_sm90-");
- registers per thread for the producer / consumer warpgroups: FA3's 24/240 (2 consumer warpgroups)
  and 32/160 (3), which `setmaxnreg` needs to sum to at most 64K per CTA;
- shared memory: H100/H200 allow 227 KiB per block (opt-in).
"""

from __future__ import annotations

import dataclasses
import math

from ...dispatch.variant import first_that_fits

# FlashAttention's sm90 head dims: every multiple of 8 up to 256 (16-bit). FP8 keeps the three it was tuned at.
HEAD_DIMS_OF = {"16bit": tuple(range(8, 257, 8)), "fp8": (64, 128, 256)}
HEAD_DIMS = HEAD_DIMS_OF["16bit"]
KINDS = ("16bit", "fp8")
# The WGMMA K step in elements (16-bit: k16, e4m3: k32): Q K^T runs over the head dim in these steps, so the
# kernel pads the head dim up to a multiple of it (see padded_head_dim).
K_STEP = {"16bit": 16, "fp8": 32}  # fp16/bf16 in, same out; e4m3 in (with descales), bf16 out
SMEM_BYTES = 232448  # 227 KiB, the sm90 opt-in maximum per block
REGISTERS_PER_SM = 65536
ELEMENT_BYTES = {"16bit": 2, "fp8": 1}
OUT_BYTES = 2  # every kind's output is 16-bit (FP8 gives bf16)
# Per consumer thread, beyond its accumulators and P: addresses, row statistics, loop state. A rough
# figure (the 128x128 d128 kernel compiled at 168 registers with 160 in tiles; ptxas decides).
REGISTER_OVERHEAD = 32


def padded_head_dim(head_dim: int, kind: str = "16bit") -> int:
    """The head dim the kernel computes with: ``head_dim`` rounded up to the WGMMA K step. TMA zero-fills the
    padding columns of Q, K and V on load and clips them on O's store (HEAD_DIM in the template)."""
    step = K_STEP[kind]
    return -(-head_dim // step) * step


@dataclasses.dataclass(frozen=True)
class Sm90FwdTile:
    """One forward kernel configuration. tile_m = 64 rows per consumer warpgroup."""

    tile_m: int
    tile_n: int
    kv_stages: int = 2
    consumer_warpgroups: int = 2
    producer_registers: int = 24
    consumer_registers: int = 240
    pingpong: bool = True  # named-barrier ordering of the consumer warpgroups' GEMMs
    # without causal masking, one CTA per SM looping over the tiles (see PERSISTENT in the template)
    persistent: bool = False
    # with persistent: causal kernels loop too, over the tiles heaviest first (PERSISTENT_CAUSAL in the template)
    persistent_causal: bool = False
    # row sums of P by a small WGMMA against an all-ones block (ROW_SUM_MMA in the template) instead of FADDs
    row_sum_mma: bool = False
    # without causal masking or PERSISTENT: a part-filled last wave's tiles may run as key-range pieces that a
    # second kernel combines (TAIL_SPLIT in the template; tail_split.py plans it per call)
    tail_split: bool = False
    # the epilogue writes O through shared memory and TMA stores, one per consumer warpgroup (TMA_STORE in the
    # template), instead of each thread storing its accumulator fragment to global memory
    tma_store: bool = False
    cluster: tuple[int, int] = (1, 1)
    # one in exp2_fma_every of a thread's softmax columns takes exp2 on the FMA pipe instead of MUFU (EXP2_FMA_EVERY
    # in the template; 0: none)
    exp2_fma_every: int = 0
    # Register spill (stack bytes, ptxas) accepted because the tile measured faster all the same; the
    # compile tests fail on any spill above it.
    accepted_spill_bytes: int = 0

    def module(self, head_dim: int, kind: str = "16bit") -> str:
        return (f"fwd_{kind}_d{head_dim}_m{self.tile_m}_n{self.tile_n}_s{self.kv_stages}"
                f"_wg{self.consumer_warpgroups}{'_pp' if self.pingpong else ''}{'_ps' if self.persistent else ''}"
                f"{'_pc' if self.persistent_causal else ''}{'_rs' if self.row_sum_mma else ''}{'_ts' if self.tail_split else ''}"
                f"{'_to' if self.tma_store else ''}{f'_e{self.exp2_fma_every}' if self.exp2_fma_every else ''}")

    def params(self, head_dim: int, kind: str = "16bit", window: bool = False, softcap: bool = False,
               sinks: bool = False, alibi: bool = False, varlen: bool = False, fixed_max: bool = False,
               kv_cache: str = "", page_rows: int = 0) -> dict:
        """The template's parameters; ``window``, ``softcap``, ``sinks``, ``alibi``, ``varlen`` and ``fixed_max``
        compile in its WINDOW, SOFTCAP, SINKS, ALIBI, VARLEN and FIXED_MAX (softcap without alibi only);
        ``kv_cache`` ("contiguous", "paged") its KV_CACHE and PAGED, with ``page_rows`` (kv_cache_reasons)."""
        if fixed_max and not (softcap and not alibi and kind == "16bit"):
            raise ValueError("fixed_max needs softcap without alibi (scores bounded by the cap), 16-bit inputs")
        reasons = kv_cache_reasons(self, kv_cache, page_rows, kind, varlen)
        if reasons:
            raise ValueError("; ".join(reasons))
        return {**dataclasses.asdict(self), "head_dim": head_dim, "head_dim_padded": padded_head_dim(head_dim, kind),
                "kind": kind, "o_in_q": self.o_in_q(head_dim, kind), "window": window, "softcap": softcap,
                "sinks": sinks, "alibi": alibi, "varlen": varlen, "fixed_max": fixed_max, "kv_cache": kv_cache,
                "page_rows": page_rows}

    def o_in_q(self, head_dim: int, kind: str = "16bit") -> bool:
        """Whether tma_store stages O in Q's buffer (O_IN_Q in the template): each consumer warpgroup writes its 64
        rows of O over its own 64 rows of Q, which only its Q K^T reads. Only where O's own buffer does not fit,
        with 16-bit inputs (Q's rows and O's the same size) and one CTA per tile (a persistent CTA loads the next
        tile's Q during the epilogue)."""
        return (self.tma_store and kind == "16bit" and not self.persistent
                and self._smem_bytes(head_dim, kind, own_o_buffer=True) > SMEM_BYTES)

    def smem_bytes(self, head_dim: int, kind: str = "16bit") -> int:
        return self._smem_bytes(head_dim, kind, own_o_buffer=self.tma_store and not self.o_in_q(head_dim, kind))

    def _smem_bytes(self, head_dim: int, kind: str, own_o_buffer: bool) -> int:
        head_dim = padded_head_dim(head_dim, kind)
        tiles = self.tile_m * head_dim + 2 * self.kv_stages * self.tile_n * head_dim  # Q, K and V stages
        ones = ELEMENT_BYTES[kind] * 8 * self.tile_n + 1024 if self.row_sum_mma else 0  # all-ones block, 1024-aligned
        out = OUT_BYTES * self.tile_m * head_dim + 1024 if own_o_buffer else 0  # O's staging buffer, 1024-aligned
        return ELEMENT_BYTES[kind] * tiles + ones + out + 8 * (2 + 4 * self.kv_stages) + 1024  # mbarriers, alignment

    def registers_needed(self, head_dim: int, kind: str = "16bit") -> int:
        """Per consumer thread: S (64 x tile_n fp32), O (64 x head_dim fp32) and P (16-bit: two per
        register; fp8: four) over a warpgroup's 128 threads, plus REGISTER_OVERHEAD."""
        p_per_register = 4 // ELEMENT_BYTES[kind]
        head_dim = padded_head_dim(head_dim, kind)
        return (64 * self.tile_n + 64 * head_dim + 64 * self.tile_n // p_per_register) // 128 + REGISTER_OVERHEAD

    def describe(self, head_dim: int | None = None) -> str:
        return (f"{self.tile_m}x{self.tile_n} s{self.kv_stages} {self.consumer_warpgroups} consumer warpgroups"
                f"{' pingpong' if self.pingpong else ''}{' persistent' if self.persistent else ''}"
                f"{' causal too' if self.persistent_causal else ''}{' row sums by MMA' if self.row_sum_mma else ''}{' tail split' if self.tail_split else ''}"
                f"{' TMA store' if self.tma_store else ''}"
                f"{f' exp2 on FMA 1/{self.exp2_fma_every}' if self.exp2_fma_every else ''}")


def check(tile: Sm90FwdTile, head_dim: int, kind: str = "16bit") -> list[str]:
    """The one validity check: reasons ``tile`` cannot serve ``head_dim`` (empty: it can)."""
    reasons = []
    name = tile.describe()
    if kind not in ELEMENT_BYTES:
        reasons.append(f"unknown input kind {kind!r}")
        return reasons
    if head_dim not in HEAD_DIMS_OF[kind]:
        reasons.append(f"head_dim {head_dim} has no cute_sm90 kernel for {kind} inputs ({served(kind)})")
    elif padded_head_dim(head_dim, kind) != head_dim:
        if not tile.tma_store:
            reasons.append(f"{name}: head_dim {head_dim} is padded to {padded_head_dim(head_dim, kind)} in the kernel, "
                           "which needs the TMA-store epilogue (it clips the padding columns)")
        if tile.tail_split:
            reasons.append(f"{name}: tail_split's workspaces are not padded (head_dim {head_dim})")
    if tile.consumer_warpgroups not in (1, 2, 3) or tile.tile_m != 64 * tile.consumer_warpgroups:
        reasons.append(f"{name}: tile_m must be 64 x consumer warpgroups (1-3), one WGMMA row block each")
    if tile.tile_n % 16 or not 16 <= tile.tile_n <= 256:
        reasons.append(f"{name}: tile_n must be a multiple of 16 in [16, 256] (WGMMA N; P feeds P @ V in 16-key steps)")
    if kind == "fp8" and tile.tile_n % 32:
        reasons.append(f"{name}: FP8 needs tile_n a multiple of 32 (the e4m3 WGMMA's K step)")
    if tile.kv_stages < 1:
        reasons.append(f"{name}: needs at least one K/V stage")
    if tile.pingpong and tile.consumer_warpgroups < 2:
        reasons.append(f"{name}: pingpong needs two or more consumer warpgroups")
    if tile.persistent_causal and not tile.persistent:
        reasons.append(f"{name}: persistent_causal makes a persistent kernel's causal variant loop too; set persistent")
    if tile.tail_split and tile.persistent:
        reasons.append(f"{name}: tail_split is for one CTA per tile (a persistent kernel balances its own tiles)")
    if tile.cluster != (1, 1):
        reasons.append(f"{name}: thread-block clusters are not implemented (cluster {tile.cluster})")
    if tile.exp2_fma_every < 0:
        reasons.append(f"{name}: exp2_fma_every must be 0 (none) or n > 0 (one in n columns), got {tile.exp2_fma_every}")
    if tile.smem_bytes(head_dim, kind) > SMEM_BYTES:
        reasons.append(f"{name} at head_dim {head_dim} needs {tile.smem_bytes(head_dim, kind) // 1024} KiB of shared "
                       f"memory, sm90 has {SMEM_BYTES // 1024} KiB")
    regs = [tile.producer_registers, tile.consumer_registers]
    if any(r % 8 or not 24 <= r <= 256 for r in regs):
        reasons.append(f"{name}: setmaxnreg counts must be multiples of 8 in [24, 256], got {regs}")
    total = 128 * (tile.producer_registers + tile.consumer_warpgroups * tile.consumer_registers)
    if total > REGISTERS_PER_SM:
        reasons.append(f"{name}: {total} registers per CTA > {REGISTERS_PER_SM}")
    if tile.registers_needed(head_dim, kind) > tile.consumer_registers:
        reasons.append(f"{name} at head_dim {head_dim} needs ~{tile.registers_needed(head_dim, kind)} registers per "
                       f"consumer thread, has {tile.consumer_registers}")
    return reasons


WG2 = dict(consumer_warpgroups=2, producer_registers=24, consumer_registers=240)
WG3 = dict(consumer_warpgroups=3, producer_registers=32, consumer_registers=160)

# Lists in order of preference; the first tile that passes check() is used.
# The TMA-store epilogue (tma_store) beside each pick (tma_store/tma_store.json, 5 interleaved rounds, outputs
# bit-identical to the pick's), median ratio per round, N=4k / N=16k, full / causal: FP8 d=128 1.053/1.072,
# 1.044/1.010 (N=16k full 956 vs 914); FP8 d=256 1.091/1.090, 1.006/1.026; FP8 d=64 1.030/1.021, 1.024/0.996;
# bf16 d=128 1.021/1.041, 1.007/1.017; bf16 d=64 1.024/1.056, 0.998/1.017. Taken by every pick.
# 16-bit d=256 has no room for O's own buffer (258 KiB of shared memory), so it stages O in Q's (o_in_q;
# tma_store/tma_store_d256.json, N=1k/4k/16k full: 1.124/1.059/1.042, causal 1.123/1.050/1.018).
# Tail split beside the one-CTA-per-tile picks (tma_store/split_*.json, non-causal): bf16 d=64 at 8 heads
# 1.060 (N=4k) and 1.119 (N=16k, 537 vs 479), but not taken: the launch-cost problem (B=1, H=8, N=128, d=64,
# bf16) then goes through run_kernel's split path and the kernel's four extra arguments, and attention() took
# 22.9 us per call against SDPA's 21.2 in the same run (tma_store/launch_cost_final.json; 20.2 vs 20.4 without).
# bf16 d=256 1.015/1.011 and FP8 d=256 1.016/1.004 (at the benchmark's 8 heads, 16k tokens): within the noise.
# FP8 d=128 persistent instead of the tail split 0.992/0.965, 3 stages 0.999/0.995, without the split
# 0.988/0.956 (tma_store/fp8_d128_persistent.json).
FWD: dict[str, dict[int, list[Sm90FwdTile]]] = {
    "16bit": {
        # H200 sweep (same file): 128x128 s2 at d=128: 638-642 TFLOP/s at N=16k with or without
        # pingpong, 640 with 3 stages; 128x160 610 and FA3's 128x176 486 (causal 445 / 346).
        # Non-causal, persistent vs one CTA per tile (persistent/persist_16bit.json): N=1k/4k/16k 526/613/657
        # vs 500/606/645. At d=64 (192x128: 376/476/525 vs 370/490/532) and d=256 (128x64: 534/637/666 vs
        # 528/632/676) it does not pay, so those stay one CTA per tile.
        128: [Sm90FwdTile(128, 128, 2, persistent=True, tma_store=True, **WG2)],
        # d=64: 128x128 437/411 at N=16k (full/causal) vs 192x128 with 3 warpgroups 381/340, 128x192 419/391.
        # With P converted by inline PTX (with the DSL's conversion the PTX computed every exp2 twice in the
        # 3-warpgroup kernel; keyblock-profile/): 128x128 464/461, 192x128 3 warpgroups 535/497 (FA4's tile,
        # FA4 540). Side by side (persistent/bench.json, N=16k full/causal) 525/485 vs FA4 546/513, cuDNN 459/449.
        # Its causal kernels kept 56 bytes on the stack (ptxas, at 160 registers; 0-16 before the persistent
        # tile loop was added to the template): the stores and loads sit in the loop over the diagonal (masked)
        # blocks, a few per tile; the unmasked loop has none. With the TMA-store epilogue ptxas keeps 16 bytes.
        64: [Sm90FwdTile(192, 128, 2, tma_store=True, accepted_spill_bytes=16, **WG3)],
        # FA3's 128x80 at d=256 vs 128x64: 638/562 vs 645/578 TFLOP/s at N=16k (full/causal), 608 vs 619
        # at N=4k (H200 sweep, benchmarks/results/2026-11-29-h200-cute_sm90/sweep.json). With P converted by
        # inline PTX (exp2 no longer computed twice; keyblock-profile/): 128x64 698/669.
        256: [Sm90FwdTile(128, 64, 2, tma_store=True, **WG2), Sm90FwdTile(128, 80, 2, tma_store=True, **WG2)],
    },
    # FP8 (e4m3 in, bf16 out), H200 sweep at N=16k (benchmarks/results/2026-11-29-h200-cute_sm90-fp8/
    # sweep_fp8.json), kernel alone, full/causal TFLOP/s: d=64 192x128 with 3 warpgroups 631/616 (128x128
    # 513/501, 128x192 556/561); d=128 128x128 877/879 (128x160, 128x192, 3 stages, no pingpong: no
    # better); d=256 128x128 1168/1145 despite a 56-byte spill (128x96 1089/1056, 128x64 1010/987).
    # fp8-profile/ (d=128 non-causal): 192x64 with 3 warpgroups 819, 192x96 889 vs 878; O rescaled before
    # P V, exp2 partly on the FMA pipe and split row reductions were all slower. keyblock-profile/ (d=128):
    # 192x96 with 3 warpgroups beats 128x128 non-causal in each of four runs (N=16k 888/872, 877/869,
    # 882/857; N=4k +1.5%) but loses causal (866/888 at 16k, 714/738 at 4k), where 128x128 beats cuDNN:
    # 128x128 stays (the table has no causal key). 128x224 882/872 but 800/816 at 4k; skipping O's rescale
    # by warp vote, a speculative softmax (exp2 against the running max) and S one block ahead: slower.
    # Non-causal, persistent vs one CTA per tile (persistent/persist_fp8.json), N=1k/4k/16k: d=64
    # 420/573/639 vs 397/562/638; d=128 634/806/854 vs 613/817/881 and d=256 811/1082/1172 vs 800/1104/1176
    # (not persistent).
    # row_sum_mma/fp8rs2_*.json (one run; FP8 relative error unchanged at 2.6e-2): row sums by a WGMMA
    # against ones (row_sum_mma) take ~60 of ~440 instructions per warp and key block out of the softmax.
    # d=128 192x96 3 warpgroups: N=16k 936/894 (full/causal) vs 885/855 without, N=4k 859/699 vs 814/677;
    # the 128x128 pick it replaces 887/880, 814/697 (with row_sum_mma 848/869: slower). Persistent 192x96 920
    # (full, 16k). d=64 persistent 192x128: 683/635, 603/494 vs 638/617, 573/484. d=256: equal (1208 vs 1205),
    # not taken. 16-bit: slower at every head dim (its tensor time is twice FP8's), not taken.
    # FlashAttention-4's conditional rescale (stale max kept within 0.8 log2 units, warp vote to skip O's
    # rescale) on top: slower (row_sum_mma/thresh_d128.json: 920 vs 958 at d=128, 671 vs 685 at d=64).
    # The d=128 causal kernel keeps 8 bytes on the stack (two values stored before the key-block loops,
    # reloaded after them: none inside the loops).
    # tail_split/ (docs/performance.md): at N=16k (B=1, H=16) the 192-row tiles fill 10.42 waves of 132 SMs, and the
    # part-filled 11th cost ~0.7 of a full wave. tail_split runs those tiles as key-range pieces (tail_split.py):
    # 929 vs 903 TFLOP/s (9 interleaved rounds, kernel alone), cuDNN's FP8 926 in the same rounds. Only d=128 has
    # it: at the other picks' benchmark shapes the plan would keep every tile whole.
    # With the TMA-store epilogue the d=256 kernel's spill is 48 bytes (56 before), the d=128 causal kernel's
    # still 8.
    "fp8": {
        64: [Sm90FwdTile(192, 128, 2, persistent=True, row_sum_mma=True, tma_store=True, **WG3)],
        128: [Sm90FwdTile(192, 96, 2, row_sum_mma=True, tail_split=True, tma_store=True, accepted_spill_bytes=8, **WG3)],
        256: [Sm90FwdTile(128, 128, 2, tma_store=True, accepted_spill_bytes=48, **WG2)],
    },
}

# The other 16-bit head dims (multiples of 8 without an entry in FWD): the tiles of the first range whose
# upper bound is at least the head dim. H200 sweep (benchmarks/results/2026-12-01-h200-head-dims/sweep.json,
# bf16, 16k tokens, heads 2048/d, kernel alone), TFLOP/s at N=16k full/causal (N=4k full/causal):
# - d=48: 192x128 3 warpgroups 448/396 (428/353); 128x128 381/357, persistent 388/360.
# - d=80: 192x96 3 warpgroups 534/495 (514/447); 128x128 505/450, persistent 501/450, 128x160 496/431,
#   128x176 514/450.
# - d=96: 128x176 586/519 (549/484); 192x96 3 warpgroups 600/481 (576/453), 128x128 573/513, persistent
#   575/498, 128x160 567/503. 128x176 has the best sum over the four.
# - d=112: 128x128 persistent 596/524 (568/503), one CTA per tile 591/524 (565/503).
# - d=160: 128x128 686/675 (655/580); 128x112 667/605, 128x96 650/601.
# - d=192: 128x112 718/658 (702/591); 128x96 715/659 (684/597), 128x80 696/626, 128x64 671/606. (128x128
#   and a persistent 128x112 do not fit in shared memory.)
# - d=224: 128x80 687/594 (656/579); 128x64 657/573.
# Later entries in a list are for head dims of the range where the first does not fit (check()).
FWD_RANGES: dict[str, list[tuple[int, list[Sm90FwdTile]]]] = {
    "16bit": [
        (64, [Sm90FwdTile(192, 128, 2, tma_store=True, accepted_spill_bytes=16, **WG3)]),
        (80, [Sm90FwdTile(192, 96, 2, tma_store=True, **WG3)]),
        (96, [Sm90FwdTile(128, 176, 2, tma_store=True, **WG2)]),
        (128, [Sm90FwdTile(128, 128, 2, persistent=True, tma_store=True, **WG2)]),
        (160, [Sm90FwdTile(128, 128, 2, tma_store=True, **WG2), Sm90FwdTile(128, 112, 2, tma_store=True, **WG2)]),
        (192, [Sm90FwdTile(128, 112, 2, tma_store=True, **WG2), Sm90FwdTile(128, 96, 2, tma_store=True, **WG2)]),
        (224, [Sm90FwdTile(128, 80, 2, tma_store=True, **WG2), Sm90FwdTile(128, 64, 2, tma_store=True, **WG2)]),
        (256, [Sm90FwdTile(128, 64, 2, tma_store=True, **WG2)]),
    ],
}


# Where triton_fa2 measured faster on the H200: (kind, head_dim) -> ([from, below) seqlen_k, the measurement
# the Decision quotes). Empty: d=64 had (1024, 4096) from benchmarks/results/2026-11-29-h200-cute_sm90/
# bench.json (N=1024: triton_fa2 332 vs 289 TFLOP/s with the 128x128 kernel), but the 192x128
# 3-warpgroup kernel now leads at every length timed (persistent/bench.json, bf16, 16k
# tokens, full/causal: N=1024 365/233 vs triton_fa2 333/225; N=4096 480/399 vs 411/352). Shorter
# sequences: the launch path dominates, and cute_sm90's is the cheaper one (benchmarks/launch_cost.py).
TRITON_FASTER: dict[tuple[str, int], tuple[int, int, str]] = {}


def fixed_max_kernel(dtype: str, softcap: bool, alibi: bool) -> bool:
    """Whether a forward of ``dtype`` ("bf16", "fp16", "fp8") has a FIXED_MAX kernel (the template says why a fixed max
    is exact there): a softcap, bf16 P (fp32's exponent range; fp16's is too narrow), no ALiBi (its bias is unbounded
    below). Built beside the running-max kernel, which serves caps above dispatch.problem.SMALL_SOFTCAP."""
    return dtype == "bf16" and softcap and not alibi


# FIXED_MAX softcap forwards at head dims up to 64 (the 64 tile's) take one exp2 in three on the FMA pipe: there the
# two MUFU operations per score (tanh, exp2) still bind against half of d=128's tensor work, and without the running
# max the FMA pipe has room. H200, softcap 30, bf16, 16k tokens, 5 interleaved rounds (benchmarks/results/
# 2026-12-04-h200-softcap-fixed-max-decode/softcap30_flags.json, d=64): 0.78-0.80 of the plain kernel, against
# 0.74-0.75 with FIXED_MAX alone and 0.71 with the running max. At d=128 it loses (0.86-0.88 against 0.89-0.92); row
# sums by MMA beside FIXED_MAX moved d=128 by -1.7% to +1.3%, not taken.
FIXED_MAX_EXP2_FMA_EVERY = ((64, 3),)  # (largest head dim, one in n columns)


def fixed_max_tile(tile: Sm90FwdTile, head_dim: int) -> Sm90FwdTile:
    """The tile a FIXED_MAX softcap forward of ``head_dim`` runs: ``tile`` with FIXED_MAX_EXP2_FMA_EVERY's split."""
    every = next((n for bound, n in FIXED_MAX_EXP2_FMA_EVERY if head_dim <= bound), 0)
    return dataclasses.replace(tile, exp2_fma_every=every) if every else tile


def fixed_max_serves(problem) -> bool:
    """Whether ``problem`` (a dispatch Problem) runs the FIXED_MAX forward: fixed_max_kernel, with a cap no larger
    than dispatch.problem.SMALL_SOFTCAP (the template's FIXED_P_LOG2 = 32 and fp32's exponent range need that)."""
    return fixed_max_kernel(problem.dtype, problem.softcap, problem.alibi) and not problem.softcap_large


# KV_CACHE kernels (attention_with_kvcache: a prefill chunk against each sequence's cached keys; KV_CACHE and PAGED
# in the template) serve automatic dispatch: their GPU tests (tests/backends/cute_sm90/test_gpu_kvcache.py) pass, and
# chunked prefill ran 1.7-4.5x triton_fa2's KV-cache kernel in the same run (H100, 2026-12-05, bf16, GQA 32/8; at
# 4 x (8k cached + 2k new), d=128: contiguous 594 against 209 TFLOP/s, pages of 64 543 against 129, pages of 16 370
# against 129; benchmarks/results/2026-12-05-h100-kvcache-twins/). Decode-shaped calls stay with triton_fa2 in any case
# (backend.py). KV_CACHE_AUTO off would pass them over again, with KV_CACHE_NOT_AUTO in the Decision.
KV_CACHE_AUTO = True
KV_CACHE_NOT_AUTO = ("its KV-cache kernels are turned off for automatic dispatch "
                     "(backends/cute_sm90/variants.py, KV_CACHE_AUTO); backend='cute_sm90' runs them")
KV_CACHE_CHOICES = ("", "contiguous", "paged")


def page_rows(tile_n: int, page_size: int) -> tuple[int, list[str]]:
    """PAGED's load size for a tile of ``tile_n`` keys and pages of ``page_size`` positions: the most rows that divide
    both (each load then lies in one page, and a block is whole loads), or the reason there is none: it must be a
    multiple of 8, TMA's loads being whole 8-row swizzle atoms of the block's shared-memory layout."""
    if page_size <= 0:
        return 0, ["the page size is not given (explain(page_size=...)): its paged kernel is compiled for it"]
    rows = math.gcd(tile_n, page_size)
    if rows % 8:
        return 0, [f"page_size {page_size}: its pages and the tile's {tile_n}-key blocks share no multiple of 8 rows "
                   f"(its paged kernel loads whole 8-row pieces of a page by TMA)"]
    return rows, []


def kv_cache_reasons(tile: Sm90FwdTile, kv_cache: str, rows: int, kind: str, varlen: bool) -> list[str]:
    """Why (tile, ``kv_cache``, ``rows``) is not a KV_CACHE kernel the template compiles: the cache kinds it knows, 16-bit
    inputs, no packed batch beside it, and for "paged" a load size page_rows could give (none otherwise)."""
    if kv_cache not in KV_CACHE_CHOICES:
        return [f"kv_cache must be one of {KV_CACHE_CHOICES}, got {kv_cache!r}"]
    reasons = []
    if kv_cache != "paged" and rows:
        reasons.append(f"page_rows {rows} without a paged cache")
    if kv_cache and kind != "16bit":
        reasons.append(f"its {kind} kernel reads no KV cache (the 16-bit ones do)")
    if kv_cache and varlen:
        reasons.append("a KV cache and a packed (varlen) batch are separate kernels")
    if kv_cache == "paged" and (rows % 8 or not 8 <= rows <= tile.tile_n or tile.tile_n % rows):
        reasons.append(f"page_rows {rows} must be a multiple of 8 that divides the tile's {tile.tile_n} keys")
    return reasons


def served(kind: str) -> str:
    """The head dims served for ``kind``, said briefly."""
    dims = HEAD_DIMS_OF.get(kind, ())
    if dims == tuple(range(8, 257, 8)):
        return "has every multiple of 8 up to 256"
    return f"has {', '.join(map(str, dims))}" if dims else "none"


def pick(kind: str, head_dim: int) -> tuple[Sm90FwdTile | None, list[str]]:
    """The tile for (kind, head_dim): the first in the table that passes check(), or the reasons."""
    candidates = FWD.get(kind, {}).get(head_dim) or next(
        (tiles for bound, tiles in FWD_RANGES.get(kind, ()) if head_dim <= bound), None)
    if not candidates or head_dim not in HEAD_DIMS_OF.get(kind, ()):
        return None, [f"head_dim {head_dim} has no cute_sm90 kernel for {kind} inputs ({served(kind)})"]
    return first_that_fits(candidates, lambda tile: check(tile, head_dim, kind))


def picks() -> list[tuple[str, int, Sm90FwdTile]]:
    """(kind, head_dim, tile) for every kernel the heuristic can pick: what codegen renders."""
    out = []
    for kind in FWD:
        for head_dim in HEAD_DIMS_OF[kind]:
            tile, _ = pick(kind, head_dim)
            if tile is not None:
                out.append((kind, head_dim, tile))
    return out

"""The cute_sm90 backward table: tile configs per head dim (16-bit inputs) and the ONE validity check that
plan_backward, codegen and `attnforge build` use.

Where the numbers come from: FlashAttention-3's sm90 backward tiles (hopper/flash_bwd_launch_template.h, as
FlashAttention-4's flash_attn/cute/interface.py _tile_size_bwd_sm90 restates them): 128 keys per CTA (two
consumer warpgroups of 64 keys), 128 query rows per step at head dim 64 and 64 at head dim 128, two stages of
Q and dO, registers 24 (producer) / 240 (consumers).
"""

from __future__ import annotations

import dataclasses

from ...dispatch.variant import first_that_fits
from .variants import HEAD_DIMS_OF, REGISTERS_PER_SM, SMEM_BYTES

# The kernels' head dims (BWD's keys). Every other head dim the forward serves (multiples of 8 up to 256) runs the
# kernel of the next one up: TMA fills the missing columns of Q, K, V and dO with zeros on load (they add 0 to
# S^T = K Q^T and dP^T = V dO^T, and give dK, dV and dQ zero columns), and the stores of dK and dV and dQ's
# reduce-add leave them out (HEAD_DIM and INPUT_HEAD_DIM in the template). No padded copy of any tensor is made.
KERNEL_HEAD_DIMS = (64, 128, 256)
HEAD_DIMS = HEAD_DIMS_OF["16bit"]
# The padded kernels (an input head dim below its kernel's) compile for sm_90a with their SASS checked
# (tests/backends/cute_sm90/test_compile.py). On the H200 (2026-12-04) their GPU tests passed
# (tests/backends/cute_sm90/test_gpu_backward.py at d=8, 40, 80, 96 and 192: 190, fp16 and bf16, causal and not,
# deterministic, large scores; test_gpu_features.py's forced window, softcap and ALiBi backwards at d=80: 10;
# test_gpu_varlen.py's packed backward at d=96), so they are served. PADDED_SERVED = False turns them off.
PADDED_SERVED = True
PADDED_REASON = ("its backward for head dims other than 64, 128 and 256 (the next kernel's, with zero-filled columns) "
                 "is turned off (backends/cute_sm90/bwd_variants.py, PADDED_SERVED)")
# Automatic dispatch and this backward (a forced cute_sm90 always runs it). Where the arch's measured cost table
# (dispatch/costs/<arch>.json) covers the pairing PLAN for the problem, it competes with the other measured plans.
# Where the table measures the problem's class but not PLAN (it times cute_sm90's forward with triton_fa2's
# backward, FALLBACK_PLAN, there), it is passed over with NOT_AUTO_BECAUSE, which the Decision quotes, so that the
# measured plans decide. Where the table measures neither (a class it does not time: more tokens per call than it
# timed, a window, softcap, ALiBi or sinks), the preference order stands and this backward follows cute_sm90's
# forward: in every same-run H200 comparison it beat triton_fa2's backward after the same forward (dense d=64/128
# at N=1k-16k: docs/performance.md; packed 16k tokens d=128: 1.13x causal, 1.33x full; softcap 30: 1.8-2.0x;
# a 4096-key window on 32k: 1.47x; benchmarks/results/2026-12-03-h200-feature-backward/ and
# 2026-12-03-h200-varlen-backward/). The shipped sm90 table measures PLAN at head dims 64 and 128 with 16k tokens
# per call (`attnforge tune --costs --head-dim 64,128 --tokens 16384` on the H200, merged in by `--merge`). Tables
# time no packed (varlen) batch: one is judged by the dense batch of its sequence count and longest lengths, the
# packed kernel being the dense one with per-sequence offsets and a heaviest-first key-block table.
PLAN = "cute_sm90+cute_sm90"
FALLBACK_PLAN = "cute_sm90+triton_fa2"
NOT_AUTO_BECAUSE = ("the cost table measures this problem's class but not its pairing (cute_sm90+cute_sm90): the "
                    "measured plans decide; backend='cute_sm90' runs it")
# The packed (VARLEN) backward kernel compiles for sm_90a with its SASS checked (tests/backends/cute_sm90/
# test_compile.py). Its LSE and delta rows are padded per sequence (a TMA load's first element in its innermost
# dimension must be 16-byte aligned; unpadded, it faulted wherever a sequence started at a row that is not a multiple
# of four). On the H200 (2026-12-03) tests/backends/cute_sm90/test_gpu_varlen.py's packed-backward cases (d=64 and 128,
# bf16 and fp16, windows, dispatch: 22) passed, and benchmarks/probe_varlen_backward.py's batches all matched fp64
# math; so it is served. PACKED = False turns it off (packed batches then take triton_fa2's VARLEN backward).
PACKED = True
PACKED_REASON = ("its packed (varlen) backward kernel is turned off "
                 "(backends/cute_sm90/bwd_variants.py, PACKED)")
# The head-dim-256 kernel (split_head_dim: SPLIT_HEAD_DIM in the template) compiles for sm_90a with its SASS checked
# (tests/backends/cute_sm90/test_compile.py). On the H200 (2026-12-03) its GPU tests passed (tests/backends/cute_sm90/
# test_gpu_backward.py -k 256: 38, fp16 and bf16, causal and not, odd and GQA shapes, deterministic, large scores),
# so it is served. SPLIT_HEAD_DIM_SERVED = False turns it off.
SPLIT_HEAD_DIM_SERVED = True
SPLIT_HEAD_DIM_REASON = ("its head-dim-256 backward kernel is turned off "
                         "(backends/cute_sm90/bwd_variants.py, SPLIT_HEAD_DIM_SERVED)")
# Its WINDOW, SOFTCAP, ALIBI and VARLEN forms (Gemma 2 and 3 train at head dim 256 with a softcap and a sliding window)
# are the template's feature code on the split tile's score coordinates: they compile for sm_90a without spilling and
# with their SASS checked (tests/backends/cute_sm90/test_compile.py). Their GPU tests (test_gpu_features.py's forced
# backward and test_gpu_varlen.py's packed backward at d=256, which serve them whatever this says) passed on an H100
# (2026-12-05: 11 and 7 passed; at d=192, on the same kernel, 9 of 11 passed and 2 were not reached within the run's
# time; benchmarks/results/2026-12-05-h100-bwd256-features/), so they are served. False turns them off: those
# backwards then run on triton_fa2, and the Decision quotes SPLIT_HEAD_DIM_FEATURES_REASON.
SPLIT_HEAD_DIM_FEATURES_SERVED = True
SPLIT_HEAD_DIM_FEATURES_REASON = ("its head-dim-256 backward's sliding-window, softcap, ALiBi and packed (varlen) forms "
                                  "are turned off (backends/cute_sm90/bwd_variants.py, SPLIT_HEAD_DIM_FEATURES_SERVED; "
                                  "the dense, plain one is served)")
# Tiles the table holds for calls without a causal mask or window (unmasked_only: d=128's 80-row tile). Its plain
# kernel passed its GPU test against fp64 math on an H100 (2026-12-05: test_gpu_backward.py -k 80_row, 28 cases) and
# ran 0.9-3.4% faster than the 64-row tile (benchmarks/results/2026-12-05-h100-bwd80/). Its other forms passed theirs
# on an H100 (2026-12-06, benchmarks/results/2026-12-06-h100-bwd80-served/: test_gpu_backward.py 334 passed, the
# deterministic and padded d=80/96 forms among them; test_gpu_features.py's forced window, softcap and ALiBi
# backwards at d=128/96/80, 22; test_gpu_varlen.py's packed ones at d=128/96, 18), so they are served. False makes
# pick() pass over such tiles to the masked calls' tile.
UNMASKED_ONLY_SERVED = True
# Per consumer thread beyond the accumulators and P: addresses, loop state, the LSE and delta of its columns.
# A rough figure: ptxas decides, and the compile test fails on a spill the table does not accept.
REGISTER_OVERHEAD = 16


@dataclasses.dataclass(frozen=True)
class Sm90BwdTile:
    """One backward kernel configuration: tile_m query rows per step, tile_n keys per CTA (64 per consumer
    warpgroup)."""

    tile_m: int
    tile_n: int = 128
    q_stages: int = 2
    # stages of dO (with its delta) where not q_stages: FlashAttention-4 runs head dim 256 on two Q stages and one dO
    # stage (flash_attn/cute/interface.py, _tile_size_bwd_sm90)
    do_stages: int | None = None
    producer_registers: int = 24
    consumer_registers: int = 240
    accepted_spill_bytes: int = 0
    # ptxas serializes the WGMMAs (a wait after each) where it cannot keep their registers in flight; the compile
    # test fails on that unless the table accepts it here, with the measurement that kept the tile
    accepts_serialized_wgmma: bool = False
    # two warpgroups share tile_n = 64 keys and split the head dim (SPLIT_HEAD_DIM in the template: P^T and dS^T
    # through shared memory), for head dims whose dK and dV do not fit one warpgroup's registers
    split_head_dim: bool = False
    # the LSE and delta of a query block read into registers while S^T's and dP^T's WGMMAs run (STATS_AHEAD in the
    # template), not in the loops after the waits
    stats_ahead: bool = False
    # dS stored keys-contiguous by the transposing stmatrix, so dQ = dS K reads it K-major (DS_KEY_MAJOR in the
    # template); not with split_head_dim
    ds_key_major: bool = False
    # dK and dV stored through shared memory by two TMA stores (TMA_STORE_DKV in the template; packed batches keep the
    # element-wise stores)
    tma_store_dkv: bool = False
    # dQ computed transposed, dQ^T = K^T dS^T (DQ_TRANSPOSED in the template), so tile_m need not be a multiple of 64:
    # FlashAttention-3's 80-row query block at head dim 128 without a causal mask
    dq_transposed: bool = False
    # split_head_dim only: P^T stored as soon as it is converted and dV issued before dS is computed (DV_AHEAD in the
    # template), so dV's WGMMA runs under the dS arithmetic
    dv_ahead: bool = False
    # one dQ staging buffer that the consumer warpgroups take in turn (SHARED_DQ_STAGING in the template), not one
    # each: half the shared memory, for a second Q stage at head dim 256
    shared_dq_staging: bool = False
    # dK's WGMMA issued before dQ's, so that Q is released (and the next block's Q loaded) while dQ's runs
    # (DK_BEFORE_DQ in the template), for tiles with one Q stage
    dk_before_dq: bool = False
    # dO's stage released once dV's WGMMA is done, before dK's is issued (EARLY_DO_RELEASE in the template;
    # FlashAttention-4's sm90 order), not after dQ's too; for tiles that issue dQ before dK
    early_do_release: bool = False
    # the unmasked step's code placed first in the query-block loop (UNMASKED_FIRST in the template): ptxas gives the
    # step it meets second 65-101 more instructions (its WGMMA descriptors rebuilt with 32-bit adds), so that one
    # should be the rarer, masked step
    unmasked_first: bool = False
    # each query head's masked and unmasked query blocks in loops of their own in the consumers, and (head, block)
    # nested loops in the producer and the dQ warp (SPLIT_LOOPS in the template; FlashAttention-3's structure): one
    # copy of the step per loop and no division per step; not with unmasked_first (the masked range runs first)
    split_loops: bool = False
    # the consumers wait for Q and dO by a try-wait first, then the blocking wait if it failed (TRY_WAIT_FIRST in the
    # template; FlashAttention-4's sm90 consumer waits): two hardware suspends inline before ptxas's retry loop
    try_wait_first: bool = False
    # K loaded on a barrier of its own ahead of the first query block's Q, and V after that Q (K_FIRST in the
    # template): the first S^T = K Q^T waits for K and Q only, not for V too (FlashAttention-4's sm90 load order)
    k_first: bool = False
    # dQ staged flat in the accumulator's register order (128-bit stores, no swizzle) and added by a 1-D bulk
    # reduce-add into an accumulator padded to whole query blocks, whose order the dQ conversion undoes (FLAT_DQ in
    # the template; FlashAttention-4's sm90 dQ path); not for packed batches
    flat_dq: bool = False
    # causal kernels only (not windowed, packed or deterministic): a 1-D grid that starts the key blocks longest first
    # across sections of this many (kv head, batch) pairs, each section's key block 0 of every pair first (LONGEST_FIRST
    # in the template); 0: the grid's own order, key blocks fastest
    longest_first: int = 0
    # one CTA per SM looping over the key blocks, each taken from a tile counter as the SM frees (PERSISTENT in the
    # template): the next key block's K, V and first Q and dO load while this one's dK and dV are converted and stored,
    # which are staged in dS's buffer (and a K-sized buffer of their own where dS's holds fewer than two K tiles); needs
    # tma_store_dkv and as many dO stages as Q stages, not split_head_dim, k_first or longest_first
    persistent: bool = False
    # the table serves this tile only to calls without a causal mask or window (masked calls take the next entry):
    # FlashAttention-3 and -4 run head dim 128 on 80-row query blocks without a mask and 64-row ones with it
    # (FlashAttention-4's flash_attn/cute/interface.py, _tile_size_bwd_sm90). Not part of the kernel.
    unmasked_only: bool = False

    @property
    def consumer_warpgroups(self) -> int:
        return 2 if self.split_head_dim else self.tile_n // 64

    @property
    def dout_stages(self) -> int:
        """Stages of dO: do_stages, or q_stages where it is None."""
        return self.q_stages if self.do_stages is None else self.do_stages

    def module(self, head_dim: int) -> str:
        options = "".join(suffix for on, suffix in ((self.split_head_dim, "_sd"), (self.stats_ahead, "_sa"),
                                                    (self.ds_key_major, "_dk"), (self.tma_store_dkv, "_ts"),
                                                    (self.dq_transposed, "_dt"), (self.dv_ahead, "_dv"),
                                                    (self.shared_dq_staging, "_sq"), (self.dk_before_dq, "_kq"),
                                                    (self.early_do_release, "_er"),
                                                    (self.unmasked_first, "_uf"), (self.split_loops, "_sl"),
                                                    (self.try_wait_first, "_tw"),
                                                    (self.k_first, "_kf"),
                                                    (self.flat_dq, "_fq"),
                                                    (self.persistent, "_ps")) if on)
        options += f"_lf{self.longest_first}" if self.longest_first else ""
        stages = f"s{self.q_stages}" + ("" if self.dout_stages == self.q_stages else f"o{self.dout_stages}")
        return f"bwd_16bit_d{head_dim}_m{self.tile_m}_n{self.tile_n}_{stages}{options}"

    def params(self, head_dim: int) -> dict:
        # unmasked_only is the table's, not the kernel's: one kernel, one generated module
        kernel = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("unmasked_only", "do_stages")}
        kernel["do_stages"] = self.dout_stages
        return {**kernel, "head_dim": head_dim, "head_dim_padded": kernel_head_dim(head_dim)}

    def smem_bytes(self, head_dim: int) -> int:
        """Shared memory of the kernel for the (kernel) ``head_dim``."""
        kv = 2 * self.tile_n * head_dim * 2  # K and V
        q_do = (self.q_stages + self.dout_stages) * self.tile_m * head_dim * 2  # Q and dO stages
        ds = 2 * self.tile_m * self.tile_n * 2 * (2 if self.split_head_dim else 1)  # two dS (and P^T) stages
        dq = self.tile_m * head_dim * 4  # the fp32 dQ staging buffers of both warpgroups (or one shared: half)
        if self.shared_dq_staging:
            dq //= self.consumer_warpgroups
        # the template's Storage: the mbarriers, then the LSE and delta rows (each stage's on 128 bytes), then the
        # buffers, each 1024-byte aligned and a multiple of 1024 bytes
        stats = sum(-(-((stages - 1) * -(-self.tile_m // 32) * 32 + self.tile_m) * 4 // 128) * 128
                    for stages in (self.q_stages, self.dout_stages))
        head = 8 * (2 * (2 if self.k_first else 1) + 2 * self.q_stages + 2 * self.dout_stages) + stats
        if self.persistent:  # the tile handoff's two slots and their mbarriers
            head += 8 * 2 * 2 + 4 * 2
        return -(-head // 1024) * 1024 + kv + q_do + ds + dq + self.epilogue_extra_bytes(head_dim)

    def epilogue_extra_bytes(self, head_dim: int) -> int:
        """A persistent kernel's staging buffer for dV beside dS's (which stages dK, and dV too where it holds two K
        tiles): one K tile, or 0."""
        kv_tile = self.tile_n * head_dim * 2
        ds = 2 * self.tile_m * self.tile_n * 2
        return kv_tile if self.persistent and self.tma_store_dkv and ds < 2 * kv_tile else 0

    def registers_needed(self, head_dim: int) -> int:
        """Per consumer thread at the busiest point: dK and dV (64 x head_dim fp32 each), S^T and dP^T
        (64 x tile_m fp32 each) and P^T (16-bit, two per register), over a warpgroup's 128 threads. With
        split_head_dim: dK and dV of half the head dim, and the larger of S^T with dP^T (half the queries each) and
        dQ (tile_m x half the head dim), which are not alive together."""
        if self.split_head_dim:
            half = head_dim // 2
            return (2 * 64 * half + max(2 * 64 * self.tile_m // 2, self.tile_m * half)) // 128 + REGISTER_OVERHEAD
        stats = self.tile_m // 4 if self.stats_ahead else 0  # a thread's columns' LSE (or delta)
        if self.dq_transposed:  # S^T and dP^T (fp32), or later P^T and dS^T (16-bit) beside dQ^T (fp32): as many
            return (2 * 64 * head_dim + 2 * 64 * self.tile_m) // 128 + stats + REGISTER_OVERHEAD
        return (2 * 64 * head_dim + 2 * 64 * self.tile_m + 64 * self.tile_m // 2) // 128 + stats + REGISTER_OVERHEAD

    def describe(self) -> str:
        options = "".join(note for on, note in ((self.split_head_dim, " splitting the head dim"),
                                                (self.stats_ahead, ", row stats ahead"),
                                                (self.ds_key_major, ", dS key-major"),
                                                (self.tma_store_dkv, ", dK/dV by TMA"),
                                                (self.dq_transposed, ", dQ transposed"),
                                                (self.dv_ahead, ", dV ahead of dS"),
                                                (self.shared_dq_staging, ", one dQ staging buffer"),
                                                (self.dk_before_dq, ", dK before dQ"),
                                                (self.early_do_release, ", dO released after dV"),
                                                (self.unmasked_first, ", unmasked step first"),
                                                (self.split_loops, ", masked and unmasked loops apart"),
                                                (self.try_wait_first, ", try-wait first"),
                                                (self.k_first, ", K before the first Q"),
                                                (self.flat_dq, ", dQ staged flat"),
                                                (self.persistent, ", persistent")) if on)
        if self.longest_first:
            options += f", causal key blocks longest first by {self.longest_first} kv heads"
        stages = f"s{self.q_stages}" + ("" if self.dout_stages == self.q_stages else f"/{self.dout_stages}")
        return f"{self.tile_m}x{self.tile_n} {stages} {self.consumer_warpgroups} consumer warpgroups{options}"


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the kernel that serves ``head_dim``: the first of KERNEL_HEAD_DIMS at least as large (the
    largest where none is: check() then refuses)."""
    return next((d for d in KERNEL_HEAD_DIMS if d >= head_dim), KERNEL_HEAD_DIMS[-1])


def _no_backward(head_dim: int) -> str:
    return f"head_dim {head_dim} has no cute_sm90 backward (has every multiple of 8 up to 256)"


def check(tile: Sm90BwdTile, head_dim: int) -> list[str]:
    """The one validity check: reasons ``tile`` cannot serve ``head_dim`` (empty: it can). The tile is checked at
    the kernel's head dim (kernel_head_dim)."""
    if head_dim not in HEAD_DIMS:
        return [_no_backward(head_dim)]
    reasons, head_dim = [], kernel_head_dim(head_dim)
    if tile.split_head_dim:
        if tile.tile_n != 64 or tile.tile_m != 64:
            reasons.append(f"split_head_dim takes 64 x 64 tiles (two warpgroups on 64 keys), not "
                           f"{tile.tile_m}x{tile.tile_n}")
        if head_dim // 2 not in (64, 128):
            reasons.append(f"split_head_dim gives each warpgroup {head_dim // 2} of head_dim {head_dim}'s columns, not "
                           "a multiple of the 128-byte swizzle width")
        if tile.ds_key_major:
            reasons.append("split_head_dim reads dS's bytes as dS^T for dK: ds_key_major does not apply")
    elif tile.tile_n != 128:
        reasons.append(f"tile_n {tile.tile_n} != 128 (two consumer warpgroups of 64 keys)")
    if tile.longest_first < 0:
        reasons.append(f"longest_first {tile.longest_first} < 0 (kv heads per section; 0 is off)")
    if min(tile.q_stages, tile.dout_stages) < 1:
        reasons.append(f"{tile.q_stages} Q and {tile.dout_stages} dO stages: each needs at least one")
    if tile.early_do_release and tile.dk_before_dq:
        reasons.append("early_do_release releases dO before dK is issued, which dk_before_dq issues ahead of dQ")
    if tile.split_loops and tile.unmasked_first:
        reasons.append("split_loops runs the masked query blocks' loop first: unmasked_first does not apply")
    if tile.dv_ahead and not tile.split_head_dim:
        reasons.append("dv_ahead issues dV from P^T in shared memory, which only split_head_dim stores there")
    if tile.dq_transposed:
        if tile.split_head_dim or head_dim != 64 * tile.consumer_warpgroups:
            reasons.append(f"dq_transposed gives each of {tile.consumer_warpgroups} warpgroups 64 of dQ's columns: "
                           f"head_dim {head_dim} is not {64 * tile.consumer_warpgroups}")
        if tile.tile_m % 16 or not 16 <= tile.tile_m <= 128:
            reasons.append(f"dq_transposed takes tile_m a multiple of 16 up to 128 (dK's and dV's K step), not "
                           f"{tile.tile_m}")
    elif tile.tile_m not in (64, 128):
        reasons.append(f"tile_m {tile.tile_m} is not 64 or 128 (dQ splits by 64-row warpgroups or by columns; "
                       "dq_transposed takes others)")
    if tile.flat_dq and not tile.dq_transposed and tile.tile_m not in (64, 64 * tile.consumer_warpgroups):
        reasons.append(f"flat_dq stages each warpgroup's dQ as one 64-row WGMMA tile: tile_m {tile.tile_m} gives a "
                       "warpgroup more rows")
    if tile.tile_m == 64 and head_dim // tile.consumer_warpgroups not in (64, 128):
        reasons.append(f"tile_m 64 splits dQ's {head_dim} columns into {head_dim // tile.consumer_warpgroups}, "
                       "not a 128-byte swizzle width")
    if tile.persistent:
        needs = [(not tile.tma_store_dkv, "tma_store_dkv (dK and dV staged for TMA stores)"),
                 (tile.dout_stages != tile.q_stages, "as many dO stages as Q stages"),
                 (tile.split_head_dim, "no split_head_dim"), (tile.k_first, "no k_first"),
                 (tile.longest_first, "no longest_first (its tiles come from a counter in the grid's order)"),
                 (2 * tile.tile_m * tile.tile_n < tile.tile_n * head_dim,
                  f"dS's buffer to hold a K tile ({tile.tile_m} x {tile.tile_n} x 2 < {tile.tile_n} x {head_dim})")]
        reasons += [f"persistent needs {need}" for failed, need in needs if failed]
    if tile.smem_bytes(head_dim) > SMEM_BYTES:
        reasons.append(f"shared memory {tile.smem_bytes(head_dim)} B > {SMEM_BYTES} B")
    if tile.registers_needed(head_dim) > tile.consumer_registers:
        reasons.append(f"needs ~{tile.registers_needed(head_dim)} registers per consumer thread > "
                       f"{tile.consumer_registers}")
    if 128 * (tile.producer_registers + tile.consumer_warpgroups * tile.consumer_registers) > REGISTERS_PER_SM:
        reasons.append("producer + consumer registers exceed 64K per CTA")
    return reasons


# Register spill accepted (ptxas stack bytes): d=64 8 (one value kept across the loop; 64 x 128 scores per
# warpgroup at 240 registers), d=128 none. Measured forward+backward at N=16k (H200, bf16, TFLOP/s full/causal):
# d=128 554/542, d=64 487/467, against FlashAttention-4's 614/576 and 523/516 and cuDNN's 536/527 and 446/430 in
# the same run (benchmarks/results/2026-12-01-h200-cute_sm90-bwd-order/). A 64-row query block at d=64 would free
# registers, but then dQ's 32 columns per warpgroup are below a 128-byte swizzle (check()).
# d=128 stores dK and dV by TMA (tma_store_dkv): beside the same tile without it, 7 of 8 (N, mask) rows faster,
# +1.6% on average (-2.6% to +4.5%), in two sweeps on an H100 (2026-12-05, 3 and 5 rounds); 0.93-0.97x FA4 and
# 1.03-1.08x cuDNN there (benchmarks/results/2026-12-05-h100-kvcache-twins/). At d=64, +0.5% on average at N=4k/16k
# there, but where each CTA has few query blocks its epilogue weighs more: 3 rounds on an H100 (2026-12-06,
# benchmarks/results/2026-12-06-h100-d64-tma-store/), full/causal, N=1k 365.1/262.7 against 352.4/249.4 (+3.6%/+5.3%),
# 4k 464.3/408.3 against 458.4/396.7 (+1.3%/+2.9%); FA4 388.6/274.9 and 481.1/432.6 in the same rounds. Taken.
# Calls without a causal mask or window take 80-row query blocks at d=128 (FlashAttention-3/4's sm90 choice; FA4
# interface.py _tile_size_bwd_sm90), dQ transposed so its columns split by warpgroup: beside the 64-row tile, 5
# interleaved rounds on an H100, 16k tokens, full: N=16k 590.5 vs 580.9, 4k 541.0 vs 536.0, 1k 449.4 vs 434.6 (FA4
# 612.9/566.3/456.5, cuDNN 545.5/518.7/415.3; benchmarks/results/2026-12-05-h100-bwd80/). Masked calls keep 64
# rows, as FlashAttention-3/4 do; the 80-row tile has not been timed with a mask. (Served: UNMASKED_ONLY_SERVED.)
# Head dim 256 (FlashAttention-3's tiles there: 64 query rows, 80 keys, the head dim split between two warpgroups):
# 64 x 64 with one stage of Q and dO, to fit 227 KB of shared memory. H200, bf16, forward+backward at 16k tokens
# (benchmarks/results/2026-12-03-h200-bwd256/sweep.json), TFLOP/s full/causal: N=16k 351/372, N=4k 342/329, N=1k
# 295/243, against FlashAttention-4's 432/433, 414/387, 346/283 and cuDNN's 415/426, 424/388, 348/281 in the same
# rounds (triton_fa2's backward, the one served before: 106/110).
# It issues dK's WGMMA before dQ's (dk_before_dq): with one Q stage the next block's Q loads only once Q is released,
# which dK's completion gates; dK first releases it under dQ's WGMMA and staging. Beside the same tile without it,
# forward+backward, bf16, 16k tokens, 3 interleaved rounds on an H100 (2026-12-06,
# benchmarks/results/2026-12-06-h100-bwd256-dk-first/twin256.json), TFLOP/s full/causal: N=16k 458.4/454.8 against
# 352.5/359.1, 4k 430.4/381.4 against 332.3/313.2, 1k 338.6/260.2 against 279.4/226.2 (+15% to +30%); FlashAttention-4
# 390.4/392.4, 375.6/349.5, 311.7/245.1 and cuDNN 404.8/408.0, 382.6/360.7, 329.9/259.8 in the same rounds. Two Q
# stages with one dO stage (FlashAttention-4's head-dim-256 choice), which fit beside one dQ staging buffer shared by
# the warpgroups (shared_dq_staging), ran 451.7/440.5, 418.6/378.6, 341.6/259.9: level at 1k, 1-3% behind at 4k and 16k;
# with dK first too, 443.4/432.7, 417.9/377.6, 338.3/259.4. Not taken; both stay template options (--twin).
# d=64 and d=128 stage dQ flat (flat_dq: FlashAttention-4's order, 128-bit stores and a 1-D bulk reduce-add). Beside
# the same tiles without it, forward+backward, bf16, 16k tokens, on an H100 (2026-12-06,
# benchmarks/results/2026-12-06-h100-flat-dq/: 3 rounds at N=1k/4k/16k, then 5 at 1k/16k), TFLOP/s flat against
# tiled: d=64 N=16k 516.6/478.8 and 510.7/495.5 full, 520.2/512.7 and 505.8/508.8 causal; N=1k 380.8/375.3 and
# 379.5/372.6 full, 269.4/264.3 and 270.1/266.8 causal; N=4k 474.3/479.4 full, 429.6/424.4 causal. d=128 (80 rows
# full, 64 causal) N=16k 607.0/571.8 and 607.1/591.5 full, 597.7/587.9 and 569.6/580.2 causal; N=1k 456.5/447.2 and
# 454.5/445.0 full, 320.2/321.7 and 322.2/317.7 causal; N=4k 558.0/555.6 full, 492.3/480.5 causal. 16 of 20 faster,
# +1.9% on average (-1.8% to +7.9%), the full calls in every row; FlashAttention-4 612.9-628.7 at d=128 N=16k full in
# the same rounds. Its GPU tests passed (115: fp16 and bf16, every kernel head dim and d=96, masked and not,
# deterministic). Calls with a window, softcap or ALiBi stage flat too (FLAT_DQ_FEATURES_SERVED, below); packed batches
# take the same tile with dQ through the swizzled tile (staging_for). d=256 keeps it off (not timed there).
# k_first (K ahead of the first query block's Q, V after it) beside the d=64 and d=128 tiles, 3 interleaved rounds on
# an H100 (2026-12-06, benchmarks/results/2026-12-06-h100-k-first/): -1.1% to +1.1% at N=1k and 4k, where it should
# help most; not taken (a template option for --twin).
# d=64 runs each query head's masked and unmasked query blocks as loops of their own (split_loops): beside the same
# tile without it, forward+backward, bf16, 16k tokens, 5 interleaved rounds on an H100 (2026-12-07,
# benchmarks/results/2026-12-07-h100-split-loops/twin64.json), TFLOP/s full/causal: N=16k 534.6/512.1 against
# 508.9/505.6, 4k 484.0/430.1 against 486.4/422.9, 1k 380.7/269.3 against 374.1/269.4 (-0.5% to +5.1%, +1.6% on
# average); FlashAttention-4 527.4/509.2, 485.5/435.4, 393.8/274.3 in the same rounds. Its GPU tests passed in every
# form (dense, deterministic, window/softcap/ALiBi, packed). With ds_key_major as well: +0.3% to +3.2% (+1.9%), its
# feature and packed forms not yet GPU-tested. At d=128 split_loops moved the 64- and 80-row tiles by -1.5% to +2.4%,
# with ds_key_major -0.5% to +0.6%, within the machine's spread: not taken there; try_wait_first -5.2% to +1.4%.
BWD: dict[int, list[Sm90BwdTile]] = {
    64: [Sm90BwdTile(128, accepted_spill_bytes=8, tma_store_dkv=True, flat_dq=True, split_loops=True)],
    128: [Sm90BwdTile(80, dq_transposed=True, tma_store_dkv=True, unmasked_only=True, flat_dq=True),
          Sm90BwdTile(64, tma_store_dkv=True, flat_dq=True)],
    256: [Sm90BwdTile(64, tile_n=64, q_stages=1, split_head_dim=True, dk_before_dq=True)],
}


def mask_reasons(tile: Sm90BwdTile, masked: bool) -> list[str]:
    """Why the table does not serve ``tile`` to a call with a causal mask or window (``masked``): empty unless the
    tile is unmasked_only."""
    return [f"the {tile.describe()} tile serves calls without a causal mask or window only"] if (
        masked and tile.unmasked_only) else []


def table_tile(head_dim: int, *, masked: bool) -> tuple[Sm90BwdTile | None, list[str]]:
    """The table's tile for a 16-bit ``head_dim`` and a call with (``masked``) or without a causal mask or window,
    served or not: the first that passes check() and mask_reasons(), or the reasons (the GPU tests and
    benchmarks/sweep_bwd_sm90.py run a kernel before it is served)."""
    candidates = BWD.get(kernel_head_dim(head_dim)) if head_dim in HEAD_DIMS else None
    if not candidates:
        return None, [_no_backward(head_dim)]
    return first_that_fits(candidates, lambda tile: check(tile, head_dim) + mask_reasons(tile, masked))


def pick(head_dim: int, *, masked: bool) -> tuple[Sm90BwdTile | None, list[str]]:
    """The backward tile the planner serves for a 16-bit ``head_dim`` and a call with (``masked``) or without a
    causal mask or window: table_tile's (the masked calls' one where an unmasked_only tile is not served:
    UNMASKED_ONLY_SERVED), unless that tile or padding is turned off (SPLIT_HEAD_DIM_SERVED, PADDED_SERVED), or the
    reasons."""
    tile, reasons = table_tile(head_dim, masked=masked)
    if tile is not None and tile.unmasked_only and not UNMASKED_ONLY_SERVED:
        tile, reasons = table_tile(head_dim, masked=True)
    if tile is not None and tile.split_head_dim and not SPLIT_HEAD_DIM_SERVED:
        return None, [SPLIT_HEAD_DIM_REASON]
    if tile is not None and head_dim != kernel_head_dim(head_dim) and not PADDED_SERVED:
        return None, [PADDED_REASON]
    return tile, reasons


# Whether the flat_dq tiles serve calls with a window, softcap or ALiBi as they are. Their kernels compile for sm_90a
# and passed their GPU tests on an H100 (2026-12-06, benchmarks/results/2026-12-06-h100-flat-dq-features/:
# test_gpu_features.py's flat_dq cases, window, softcap, ALiBi and all together at d=64, 128 and 80, 22 passed in each
# of two runs); one round of softcapped (30) and windowed (4096 left, 32k causal) training at d=128 with each staging
# there ran +2.8% to +4.5% faster flat. False: those calls take the same tile with dQ through the swizzled tile.
FLAT_DQ_FEATURES_SERVED = True


def staging_for(tile: Sm90BwdTile, window: bool, varlen: bool, softcap: bool, alibi: bool) -> Sm90BwdTile:
    """``tile``, or its twin that stages dQ through the swizzled tile (flat_dq off) for a packed batch (a sequence's
    query blocks are not whole blocks of the packed accumulator) or, unless FLAT_DQ_FEATURES_SERVED, a call with a
    window, softcap or ALiBi."""
    if tile.flat_dq and (varlen or ((window or softcap or alibi) and not FLAT_DQ_FEATURES_SERVED)):
        return dataclasses.replace(tile, flat_dq=False)
    return tile


def feature_reasons(tile: Sm90BwdTile, window: bool, varlen: bool, softcap: bool, alibi: bool) -> list[str]:
    """Why ``tile`` cannot serve a backward with these features (Sm90BwdVariant's flags): empty unless it is the
    head-dim-256 tile while its feature forms are not served (SPLIT_HEAD_DIM_FEATURES_SERVED)."""
    unserved = tile.split_head_dim and not SPLIT_HEAD_DIM_FEATURES_SERVED
    reasons = [SPLIT_HEAD_DIM_FEATURES_REASON] if unserved and (window or varlen or softcap or alibi) else []
    if tile.flat_dq and varlen:
        reasons.append(f"the {tile.describe()} tile adds dQ into whole query blocks, which a packed batch's "
                       "accumulator does not have")
    return reasons

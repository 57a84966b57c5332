"""The Triton kernel behind v_layout.prepare_v_fp8, with what `attnforge build` needs to compile it ahead
of time (its signature and constants as data, for runtime/triton_aot.py). Imported on first use: it
imports triton."""

import triton
import triton.language as tl

# Keys x head dims per program. H200, 16k tokens (benchmarks/results/2026-11-29-h200-cute_sm90-fp8-profile/
# v_layout.json): 128x64 took 21-24 us at d=64/128/256 (~3 TB/s), within 2% of the best shape at each
# (64x128 at d=128: 22.2 us vs 22.6); torch's strided copy took 115-207 us.
BLOCK_KEYS, BLOCK_DIMS = 128, 64
NUM_WARPS, NUM_STAGES = 4, 1  # Triton's defaults for a kernel without loops (num_stages unused)

# For attnforge build: the kernel as the launcher calls it, with 16-byte-aligned pointers and 32-bit
# integers (a call that breaks either goes to the JIT).
AOT_SIGNATURE = {"v_ptr": "*u8", "out_ptr": "*u8", "seqlen": "i32", "padded": "i32", "head_dim": "i32",
                 "heads": "i32", "stride_b": "i32", "stride_h": "i32", "stride_n": "i32",
                 "BLOCK_KEYS": "constexpr", "BLOCK_DIMS": "constexpr"}
AOT_CONSTEXPRS = {"BLOCK_KEYS": BLOCK_KEYS, "BLOCK_DIMS": BLOCK_DIMS}
AOT_ALIGNED = ("v_ptr", "out_ptr")
# Its 64-bit per-element addresses spill 48 bytes when Triton 3.9 compiles it for sm90 (32-bit in-tile
# offsets would not, but this is the version timed on the H200, under Triton 3.6): accepted until re-timed.
ACCEPTED_SPILL_BYTES = 48


@triton.jit
def transpose_permute_keys(v_ptr, out_ptr, seqlen, padded, head_dim, heads, stride_b, stride_h, stride_n,
                           BLOCK_KEYS: tl.constexpr, BLOCK_DIMS: tl.constexpr):
    """out[b, h, dim, slot] = v[b, h, key_of_slot(slot), dim] (uint8 views of e4m3), zero past seqlen."""
    pid_keys, pid_dims, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slots = pid_keys * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    s = slots % 32
    keys = slots - s + 16 * (s // 16) + 8 * ((s % 4) // 2) + 2 * ((s % 16) // 4) + s % 2  # v_layout.key_of_slot
    dims = pid_dims * BLOCK_DIMS + tl.arange(0, BLOCK_DIMS)
    batch, head = pid_bh // heads, pid_bh % heads
    src = (v_ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
           + keys.to(tl.int64)[:, None] * stride_n + dims[None, :])
    tile = tl.load(src, mask=(keys[:, None] < seqlen) & (dims[None, :] < head_dim), other=0)
    dst = out_ptr + pid_bh.to(tl.int64) * head_dim * padded + dims.to(tl.int64)[:, None] * padded + slots[None, :]
    tl.store(dst, tl.trans(tile), mask=(dims[:, None] < head_dim) & (slots[None, :] < padded))

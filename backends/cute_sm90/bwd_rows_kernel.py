"""The Triton kernels around cute_sm90's backward kernel (backward.py): before it, the row statistics it loads
(the LSE in log2 units and delta = rowsum(dO * O) - dLSE, padded to whole query blocks) from the 16-bit O and dO
in one pass; after it, dQ = scale * the fp32 accumulator, in the input dtype and q's strides. With torch ops the
two took about 0.5 ms of each forward+backward at 16k tokens on the H200 (fp32 copies of O and dO, then a product,
a sum, a scale and a cast: benchmarks/results/2026-12-01-h200-cute_sm90-bwd-order/profile.json), where their
bytes need about 0.1 ms. Imported on first use: it imports triton.

The 16-bit tensors' strides come in 16-byte units (stride // 8: their host code passes TMA-ready tensors, whose
strides are multiples of 8 elements) and the head dim as a constexpr, so that a prebuilt kernel knows every row
starts 16-byte aligned and its loads and stores vectorize (runtime strides and a runtime head-dim mask kept them
to 2-byte accesses, at a third of the bandwidth).
"""

import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)  # log2(e), as backends/shared/cute_host.py LOG2_E
BLOCK_ROWS = 64  # rows per program; a 64 x head_dim tile of O and dO (and of the accumulator) at a time
NUM_WARPS, NUM_STAGES = 4, 1  # no loops: num_stages unused



def aot_signature(kernel: str, dtype: str) -> dict:
    """A kernel's parameters and their Triton types for `attnforge build`, for 16-bit ``dtype`` ("bf16"/"fp16"):
    16-byte-aligned pointers and 32-bit integers (a call that breaks either goes to the JIT)."""
    ints = lambda *names: {name: "i32" for name in names}  # noqa: E731
    if kernel == "row_statistics":
        return {"out_ptr": f"*{dtype}", "dout_ptr": f"*{dtype}", "lse_ptr": "*fp32", "dlse_ptr": "*fp32",
                "lse2_ptr": "*fp32", "delta_ptr": "*fp32", "acc_ptr": "*fp32",
                **ints("has_dlse", "zero_acc", "seqlen", "padded", "heads", "stride_ob", "stride_oh", "stride_on",
                       "stride_db", "stride_dh", "stride_dn"),
                "BLOCK_ROWS": "constexpr", "HEAD_DIM": "constexpr", "D": "constexpr", "ACC_WIDTH": "constexpr"}
    return {"acc_ptr": "*fp32", "dq_ptr": f"*{dtype}", "scale": "fp32",
            **ints("seqlen", "heads", "stride_b", "stride_h", "stride_n"),
            "BLOCK_ROWS": "constexpr", "HEAD_DIM": "constexpr", "D": "constexpr"}


AOT_ALIGNED = {"row_statistics": ("out_ptr", "dout_ptr", "lse_ptr", "dlse_ptr", "lse2_ptr", "delta_ptr", "acc_ptr"),
               "scale_dq": ("acc_ptr", "dq_ptr")}


@triton.jit
def row_statistics(out_ptr, dout_ptr, lse_ptr, dlse_ptr, lse2_ptr, delta_ptr, acc_ptr, has_dlse, zero_acc, seqlen,
                   padded, heads, stride_ob, stride_oh, stride_on, stride_db, stride_dh, stride_dn,
                   BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, ACC_WIDTH: tl.constexpr):
    """For the rows of one (batch, head): lse2 = lse * log2(e) (+inf where lse is -inf: the row saw no key, its
    P is 0) and delta = sum(dout * out) in fp32 (minus dlse where has_dlse: a runtime flag, so one prebuilt kernel
    serves both); rows from seqlen to padded get +inf and 0. Where zero_acc, the rows of the fp32 dQ accumulator (acc,
    contiguous (batch * heads, seqlen, HEAD_DIM)) are set to 0 in the same pass, which saves the backward a fill
    kernel; with ACC_WIDTH (a FLAT_DQ kernel's accumulator: backward.FlatDqOrder), its (batch * heads,
    padded, ACC_WIDTH) rows, padding rows too. The
    LSE, dLSE and outputs are contiguous (batch * heads, seqlen) and (batch * heads, padded); strides in 16-byte
    units; D is HEAD_DIM rounded up to a power of two."""
    pid_rows, pid_bh = tl.program_id(0), tl.program_id(1)
    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, D)
    batch, head = pid_bh // heads, pid_bh % heads
    live = rows < seqlen
    tile = live[:, None] & (dims[None, :] < HEAD_DIM)
    o = tl.load(out_ptr + (batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                           + rows.to(tl.int64)[:, None] * stride_on) * 8 + dims[None, :], mask=tile, other=0.0)
    do = tl.load(dout_ptr + (batch.to(tl.int64) * stride_db + head.to(tl.int64) * stride_dh
                             + rows.to(tl.int64)[:, None] * stride_dn) * 8 + dims[None, :], mask=tile, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_stats = pid_bh.to(tl.int64) * seqlen + rows
    if has_dlse:
        delta -= tl.load(dlse_ptr + row_stats, mask=live, other=0.0)
    lse = tl.load(lse_ptr + row_stats, mask=live, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
    delta = tl.where(live, delta, 0.0)
    padded_rows = pid_bh.to(tl.int64) * padded + rows
    tl.store(lse2_ptr + padded_rows, lse2, mask=rows < padded)
    tl.store(delta_ptr + padded_rows, delta, mask=rows < padded)
    if zero_acc and ACC_WIDTH:
        width = tl.arange(0, ACC_WIDTH)
        tl.store(acc_ptr + padded_rows[:, None] * ACC_WIDTH + width[None, :],
                 tl.zeros((BLOCK_ROWS, ACC_WIDTH), tl.float32), mask=(rows < padded)[:, None])
    elif zero_acc:
        tl.store(acc_ptr + row_stats[:, None] * HEAD_DIM + dims[None, :], tl.zeros((BLOCK_ROWS, D), tl.float32),
                 mask=tile)


@triton.jit
def scale_dq(acc_ptr, dq_ptr, scale, seqlen, heads, stride_b, stride_h, stride_n,
             BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr):
    """dq[b, h, row] = scale * acc[b, h, row] in dq's dtype; acc is contiguous (batch, heads, seqlen, HEAD_DIM)
    fp32, dq has the strides given (in 16-byte units; head_dim contiguous)."""
    pid_rows, pid_bh = tl.program_id(0), tl.program_id(1)
    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, D)
    batch, head = pid_bh // heads, pid_bh % heads
    tile = (rows[:, None] < seqlen) & (dims[None, :] < HEAD_DIM)
    acc = tl.load(acc_ptr + (pid_bh.to(tl.int64) * seqlen + rows.to(tl.int64))[:, None] * HEAD_DIM + dims[None, :],
                  mask=tile, other=0.0)
    dst = (dq_ptr + (batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
                     + rows.to(tl.int64)[:, None] * stride_n) * 8 + dims[None, :])
    tl.store(dst, (acc * scale).to(dq_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tile)


@triton.jit
def scale_flat_dq(acc_ptr, dq_ptr, scale, seqlen, padded, heads, stride_b, stride_h, stride_n,
                  BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, TILE_M: tl.constexpr,
                  WIDTH: tl.constexpr, SPLIT: tl.constexpr, WARPGROUPS: tl.constexpr):
    """scale_dq for a FLAT_DQ kernel's accumulator: contiguous (batch, heads, padded, WIDTH) fp32, each query block of
    TILE_M rows in the order backward.FlatDqOrder describes (SPLIT 0: shares of 64 rows, 1: of WIDTH // WARPGROUPS
    columns, 2: transposed, 64 columns each), read back by gathers."""
    pid_rows, pid_bh = tl.program_id(0), tl.program_id(1)
    rows = pid_rows * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, D)
    batch, head = pid_bh // heads, pid_bh % heads
    tile = (rows[:, None] < seqlen) & (dims[None, :] < HEAD_DIM)
    r, c = (rows % TILE_M)[:, None], dims[None, :]
    if SPLIT == 0:
        share, m, n, along_n = r // 64, r % 64, c, WIDTH
    elif SPLIT == 1:
        along_n = WIDTH // WARPGROUPS
        share, m, n = c // along_n, r, c % along_n
    else:
        share, m, n, along_n = c // 64, c % 64, r, TILE_M
    offset = (share * 64 * along_n + 512 * (n // 8) + 128 * (m // 16) + 16 * (m % 8) + 4 * ((n % 8) // 2)
              + 2 * ((m // 8) % 2) + n % 2)
    block = (pid_bh.to(tl.int64) * padded + (rows // TILE_M * TILE_M).to(tl.int64)) * WIDTH
    acc = tl.load(acc_ptr + block[:, None] + offset, mask=tile, other=0.0)
    dst = (dq_ptr + (batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
                     + rows.to(tl.int64)[:, None] * stride_n) * 8 + dims[None, :])
    tl.store(dst, (acc * scale).to(dq_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tile)

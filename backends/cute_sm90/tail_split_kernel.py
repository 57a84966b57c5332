"""The Triton kernel that combines TAIL_SPLIT pieces (see tail_split.py): for every tail tile's rows, the
pieces' normalised outputs weighted by exp(lse_piece - lse), lse = log sum exp(lse_piece). Imported on
first use: it imports triton."""

import triton
import triton.language as tl

BLOCK_ROWS = 16  # rows per program: 16 x 256 fp32 at d=256 is 32 registers per thread at 4 warps
NUM_WARPS = 4


@triton.jit
def combine_pieces(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, full_tiles, pieces, m_blocks, heads, seqlen_q,
                   stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                   TILE_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """out[b, h, row] and lse[b, h, row] of tail tile program_id(0) (tile full_tiles + that), rows of
    block program_id(1). Pieces with LSE -inf weigh 0; a row whose pieces all have -inf gets 0 and -inf."""
    tail, row_block = tl.program_id(0), tl.program_id(1)
    tile = full_tiles + tail
    m_block, head, batch = tile % m_blocks, (tile // m_blocks) % heads, tile // (m_blocks * heads)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # within the tile
    valid = (rows < TILE_M) & (m_block * TILE_M + rows < seqlen_q)
    dims = tl.arange(0, HEAD_DIM)
    first = tail * pieces  # the tile's pieces are slots first .. first + pieces - 1
    lse_max = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    for j in range(pieces):
        part = tl.load(lse_part_ptr + (first + j).to(tl.int64) * TILE_M + rows, mask=valid, other=float("-inf"))
        lse_max = tl.maximum(lse_max, part)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, HEAD_DIM), tl.float32)
    for j in range(pieces):
        slot = (first + j).to(tl.int64)
        weight = tl.exp(tl.load(lse_part_ptr + slot * TILE_M + rows, mask=valid, other=float("-inf")) - shift)
        o = tl.load(o_part_ptr + (slot * TILE_M + rows[:, None]) * HEAD_DIM + dims[None, :], mask=valid[:, None],
                    other=0.0)
        acc += weight[:, None] * o
        total += weight
    seen = total > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    q_rows = (m_block * TILE_M + rows).to(tl.int64)
    base = batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + base + q_rows[:, None] * stride_on + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None])
    tl.store(lse_ptr + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + q_rows, lse, mask=valid)

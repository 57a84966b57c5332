"""The tail-split combine (backends/cute_sm90/tail_split_kernel.py) in Triton's interpreter on CPU against
fp64 math, writing into poisoned outputs: the tail tiles' rows get the merge, every other row stays
untouched. Run by ../test_tail_split.py with TRITON_INTERPRET=1."""

import pytest
import torch

from attnforge.backends.cute_sm90 import tail_split


@pytest.mark.parametrize("seqlen,head_dim", ((17, 64), (113, 128), (300, 256)))
@pytest.mark.parametrize("pieces", (2, 3))
@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float32))
def test_combine_matches_fp64(seqlen, head_dim, pieces, out_dtype, gen):
    tile_m, b, h = 64, 2, 3
    m_blocks = -(-seqlen // tile_m)
    tiles = m_blocks * h * b
    p = tail_split.Plan(tiles - 4, 4, pieces)
    o_part = torch.randn(p.slots, tile_m, head_dim, generator=gen)
    lse_part = 3 * torch.randn(p.slots, tile_m, generator=gen)
    lse_part[1, :5] = float("-inf")  # a piece that saw no key for these rows weighs nothing
    lse_part[0:pieces, 7] = float("-inf")  # a row no piece saw: 0 out, LSE -inf
    out = torch.full((b, h, seqlen, head_dim), float("nan"), dtype=out_dtype)
    lse = torch.full((b, h, seqlen), float("nan"))
    tail_split.combine(p, o_part, lse_part, out, lse, tile_m)

    want_out = torch.full(out.shape, float("nan"), dtype=torch.float64)
    want_lse = torch.full(lse.shape, float("nan"), dtype=torch.float64)
    for tail in range(p.tail_tiles):
        tile = p.full_tiles + tail
        m_block, head, batch = tile % m_blocks, (tile // m_blocks) % h, tile // (m_blocks * h)
        rows = min(tile_m, seqlen - m_block * tile_m)
        parts = slice(tail * pieces, (tail + 1) * pieces)
        l = lse_part[parts, :rows].double()
        total = torch.logsumexp(l, 0)
        weights = torch.exp(l - total).nan_to_num(0.0)  # rows with every piece at -inf: weights 0
        span = slice(m_block * tile_m, m_block * tile_m + rows)
        want_out[batch, head, span] = (weights[..., None] * o_part[parts, :rows].double()).sum(0)
        want_lse[batch, head, span] = total
    poisoned = want_out.isnan()
    assert torch.equal(out.isnan(), poisoned) and torch.equal(lse.isnan(), want_lse.isnan())
    tol = 2 ** -7 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[~poisoned].double(), want_out[~poisoned], atol=tol, rtol=tol)
    finite = want_lse.isfinite()
    assert torch.equal(lse[~finite & ~want_lse.isnan()], want_lse[~finite & ~want_lse.isnan()].float())
    torch.testing.assert_close(lse[finite].double(), want_lse[finite], atol=1e-5, rtol=1e-5)

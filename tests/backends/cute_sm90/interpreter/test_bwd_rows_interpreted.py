"""The Triton kernels around the cute_sm90 backward (backends/cute_sm90/bwd_rows_kernel.py) in Triton's
interpreter on CPU, into poisoned (NaN) outputs, against fp64 math: the row statistics (log2 LSE, +inf for rows
that saw no key, delta = rowsum(dO * O) - dLSE, padding rows +inf and 0; the dQ accumulator zeroed in the same pass)
and dQ = scale * the accumulator in q's dtype and strides. Run by ../test_backward_host.py with TRITON_INTERPRET=1."""

import math

import pytest
import torch

from attnforge.backends.cute_sm90 import backward


@pytest.mark.parametrize("seqlen", (1, 17, 113))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("with_dlse", (False, True), ids=("no-dlse", "dlse"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_row_statistics_match_fp64(seqlen, head_dim, with_dlse, dtype, gen, poisoned_empty):
    # (batch, seqlen, heads, head_dim) memory viewed as (batch, heads, seqlen, head_dim), as attention() passes it
    out, dout = (torch.randn(2, seqlen, 3, head_dim, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    lse = torch.randn(2, 3, seqlen, generator=gen)
    lse[1, 2, 0] = -math.inf  # a row that saw no key
    dlse = torch.randn(2, 3, seqlen, generator=gen) if with_dlse else None
    dq_accum = torch.full((2, 3, seqlen, head_dim), math.nan)  # the backward's dQ accumulator, set to 0 in the pass
    lse2, delta = backward.row_statistics(out, dout, lse, dlse, tile_m=64, use_triton=True, dq_accum=dq_accum)
    assert (dq_accum == 0).all()
    padded = -(-seqlen // 64) * 64
    assert lse2.shape == delta.shape == (2, 3, padded)
    want = (out.double() * dout.double()).sum(-1) - (0 if dlse is None else dlse.double())
    torch.testing.assert_close(delta[..., :seqlen].double(), want, atol=1e-5, rtol=1e-5)
    expected_lse2 = lse.double() * math.log2(math.e)
    expected_lse2[1, 2, 0] = math.inf
    torch.testing.assert_close(lse2[..., :seqlen].double(), expected_lse2, atol=1e-6, rtol=1e-6)
    assert (lse2[..., seqlen:] == math.inf).all() and (delta[..., seqlen:] == 0).all()


def test_row_statistics_keep_nan(poisoned_empty):
    out = torch.full((1, 1, 3, 64), 1.0, dtype=torch.bfloat16)
    out[0, 0, 1, 5] = math.nan
    lse2, delta = backward.row_statistics(out, torch.ones_like(out), torch.zeros(1, 1, 3), None, tile_m=64,
                                          use_triton=True)
    assert delta[0, 0, 1].isnan() and not delta[0, 0, [0, 2]].isnan().any() and not lse2.isnan().any()


@pytest.mark.parametrize("seqlen", (1, 17, 113))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_dq_is_the_scaled_accumulator_in_q_layout(seqlen, head_dim, dtype, gen, poisoned_empty):
    q = torch.randn(2, seqlen, 3, head_dim, generator=gen).to(dtype).transpose(1, 2)  # a bshd view
    acc = 50 * torch.randn(2, 3, seqlen, head_dim, generator=gen)
    acc[0, 1, 0, 3] = math.nan  # NaN stays NaN
    dq = backward.dq_from_accumulator(acc, q, 0.125, use_triton=True)
    same_layout = all(a == b for a, b, n in zip(dq.stride(), q.stride(), q.shape) if n > 1)  # size 1: any stride
    assert dq.dtype == dtype and same_layout
    assert torch.equal(dq.isnan(), acc.isnan())
    finite = ~acc.isnan()
    want = (acc.double() * 0.125).to(dtype)[finite]  # one rounding, to nearest even (cvt.rn on the GPU)
    if dtype == torch.float16:
        assert torch.equal(dq[finite], want)
    else:  # the interpreter casts fp32 to bf16 by truncation (numpy has no bf16): within one bf16 ulp here
        torch.testing.assert_close(dq[finite].double(), want.double(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("seqlen", (1, 17, 113))
@pytest.mark.parametrize("split", ("rows", "columns", "transposed"))
def test_flat_dq_in_triton_matches_the_torch_gathers(seqlen, split, gen, poisoned_empty):
    # a FLAT_DQ kernel's accumulator of each split (FlatDqOrder), read back by scale_flat_dq and by torch gathers
    order = {"rows": backward.FlatDqOrder(128, 64, 2, "rows"),
             "columns": backward.FlatDqOrder(64, 128, 2, "columns"),
             "transposed": backward.FlatDqOrder(80, 128, 2, "transposed")}[split]
    q = torch.randn(2, seqlen, 3, order.width - 8, generator=gen).to(torch.float16).transpose(1, 2)  # a padded head dim
    acc = 50 * torch.randn(order.accumulator(q).shape, generator=gen)
    acc[0, 1, 0, 3] = math.nan  # lands somewhere in row 0's block; NaN stays NaN
    dq = backward.dq_from_flat_accumulator(acc, q, 0.125, order, use_triton=True)
    want = backward.dq_from_flat_accumulator(acc, q, 0.125, order, use_triton=False)
    assert dq.dtype == torch.float16 and dq.shape == q.shape
    assert torch.equal(dq.isnan(), want.isnan()) and torch.equal(dq.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("seqlen", (1, 113))
def test_row_statistics_zero_a_flat_accumulator_padding_rows_too(seqlen, gen, poisoned_empty):
    # a FLAT_DQ kernel's accumulator: rows padded to whole query blocks, at the kernel's head dim (here 64 for d=40)
    out, dout = (torch.randn(2, 3, seqlen, 40, generator=gen).to(torch.bfloat16) for _ in range(2))
    order = backward.FlatDqOrder(128, 64, 2, "rows")
    dq_accum = order.accumulator(out).fill_(math.nan)
    backward.row_statistics(out, dout, torch.randn(2, 3, seqlen, generator=gen), None, tile_m=128, use_triton=True,
                            dq_accum=dq_accum)
    assert dq_accum.shape == (2, 3, 128, 64) and (dq_accum == 0).all()

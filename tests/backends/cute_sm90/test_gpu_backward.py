"""On an H100/H200: the cute_sm90 backward against fp64 math on fresh random inputs, from the fp64 forward's
output (rounded to the dtype) and LSE, with dK and dV poisoned (NaN) before the call so any element the kernel
fails to write shows. Odd lengths, GQA/MQA, seqlen_q != seqlen_k both ways with bottom-right causal (rows that
see no key: dQ 0), large-magnitude scores, the LSE's own gradient, every head dim of the backward table; the
deterministic kernel twice, bit for bit; the 80-row transposed-dQ tile with a mask too; the Triton kernels before and
after it."""

import dataclasses
import math

import pytest
import torch

from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.testing import assert_close, needs_gpu, oracle, peer_error

pytestmark = [pytest.mark.gpu, needs_gpu((9, 0), "sm90")]

# (batch, heads_q, heads_kv, seqlen_q, seqlen_k)
SHAPES = [(1, 2, 2, 1, 1), (2, 3, 3, 17, 17), (1, 4, 2, 113, 1023), (1, 4, 1, 1023, 113), (2, 2, 2, 300, 700),
          (1, 8, 8, 1024, 1024), (1, 6, 2, 257, 257)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def planned(dtype: str, head_dim: int, causal: bool, deterministic: bool = False, tile=None):
    """The backward Variant of the table's tile for (dtype, head_dim, causal, deterministic), served or turned off
    (bwd_variants.table_tile), or of ``tile`` (a table tile under another mask than it serves)."""
    from attnforge.backends.cute_sm90.backward import Sm90BwdVariant

    if tile is None:
        tile, why = bwd_variants.table_tile(head_dim, masked=causal)
        assert tile is not None, why
    return Sm90BwdVariant(tile, head_dim, dtype, causal, deterministic)


def check_gradients(shape, dtype, head_dim, causal, gen, *, magnitude=1.0, with_dlse=False, deterministic=False,
                    tile=None):
    from attnforge.backends.cute_sm90.backward import run

    b, hq, hkv, nq, nk = shape
    torch_dtype = DTYPES[dtype]
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).mul(m).to("cuda", torch_dtype)
               for h, n, m in ((hq, nq, magnitude), (hkv, nk, magnitude), (hkv, nk, 1.0)))
    dout = torch.randn(b, hq, nq, head_dim, generator=gen).to("cuda", torch_dtype)
    dlse = torch.randn(b, hq, nq, generator=gen).to("cuda") if with_dlse else None
    scale = head_dim ** -0.5
    ref_out, ref_lse, ref_grads = oracle(q, k, v, causal=causal, dout=dout, dlse=dlse)
    _, peer_grads = peer_error(q, k, v, causal=causal, dout=dout, dlse=dlse)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    variant = planned(dtype, head_dim, causal, deterministic, tile)
    dq, dk, dv = run(variant, q, k, v, ref_out.to(torch_dtype), ref_lse.float(), dout, scale, dlse=dlse, dk=dk, dv=dv)
    ulps = 8 * math.sqrt(max(nq, nk, head_dim))
    for name, x, ref, peer in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, peer_grads):
        assert_close(name, x, ref, peer, ulps=ulps)
    if causal and nq > nk:
        assert (dq[:, :, :nq - nk] == 0).all()
    if deterministic:  # again, into fresh poisoned outputs: the same bits
        again = run(variant, q, k, v, ref_out.to(torch_dtype), ref_lse.float(), dout, scale, dlse=dlse,
                    dk=torch.full_like(k, float("nan")), dv=torch.full_like(v, float("nan")))
        for name, x, y in zip(("dq", "dk", "dv"), (dq, dk, dv), again):
            assert torch.equal(x, y), f"{name} differs between two deterministic runs"


# The kernels' head dims, and head dims that run the next kernel with zero-filled columns (bwd_variants.kernel_head_dim:
# the smallest, and model head dims on each kernel), served or not (bwd_variants.PADDED_SERVED)
TESTED_HEAD_DIMS = (*bwd_variants.KERNEL_HEAD_DIMS, 8, 40, 80, 96, 192)
DTYPE_HEAD_DIMS = [(dtype, d) for d in TESTED_HEAD_DIMS for dtype in DTYPES]


@pytest.mark.parametrize("dtype, head_dim", DTYPE_HEAD_DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_fp64(shape, dtype, causal, head_dim, gen):
    check_gradients(shape, dtype, head_dim, causal, gen)


@pytest.mark.parametrize("head_dim", TESTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", [(2, 6, 2, 1023, 1023), (1, 4, 2, 113, 1023), (1, 4, 1, 1023, 113),
                                   (1, 2, 1, 1000, 17500)], ids=lambda s: "x".join(map(str, s)))
def test_deterministic_gradients_match_fp64_and_repeat_bit_for_bit(shape, head_dim, causal, gen):
    """deterministic=True's kernel (dQ added in key-block order): right, and the same bits twice; many key blocks
    per query block (1023 keys: 8), GQA, both seqlen orders with bottom-right causal, and more key blocks per head
    (17500 keys: 137) than the H100/H200 has SMs, so that CTAs wait on CTAs not yet resident."""
    check_gradients(shape, "bf16", head_dim, causal, gen, deterministic=True)


# FlashAttention-3's 80-row query block at d=128 (dq_transposed: dQ^T = K^T dS^T), with d=128's dK/dV TMA stores: the
# table's tile for unmasked calls (unmasked_only, which the tests above run through table_tile), here with a causal
# mask too, as benchmarks/sweep_bwd_sm90.py's twins may time it
ROWS80 = bwd_variants.table_tile(128, masked=False)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_80_row_transposed_dq_tile_matches_fp64(shape, dtype, causal, gen):
    assert (ROWS80.tile_m, ROWS80.dq_transposed, ROWS80.tma_store_dkv) == (80, True, True)
    assert bwd_variants.check(ROWS80, 128) == []
    check_gradients(shape, dtype, 128, causal, gen, tile=ROWS80)


@pytest.mark.parametrize("head_dim", TESTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_large_scores_and_the_lse_gradient(head_dim, causal, gen):
    """Scores in the hundreds (q, k scaled by 4: a peaked softmax, P near 0 or 1) and a gradient on the LSE."""
    check_gradients((1, 4, 2, 333, 555), "bf16", head_dim, causal, gen, magnitude=4.0, with_dlse=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_and_dq_kernels_on_the_gpu(dtype, gen, poisoned_empty):
    """The Triton kernels around the backward kernel, compiled for the GPU: delta and the log2 LSE against fp64
    math, the dQ accumulator zeroed in the same pass, dQ the scaled accumulator rounded once to nearest even, in q's (bshd view) strides; outputs poisoned."""
    from attnforge.backends.cute_sm90.backward import dq_from_accumulator, row_statistics

    torch_dtype = DTYPES[dtype]
    out, dout, q = (torch.randn(2, 113, 3, 128, generator=gen).to("cuda", torch_dtype).transpose(1, 2)
                    for _ in range(3))
    lse, dlse = (torch.randn(2, 3, 113, generator=gen).to("cuda") for _ in range(2))
    lse[0, 1, 7] = -math.inf
    dq_accum = torch.full((2, 3, 113, 128), math.nan, device="cuda")
    lse2, delta = row_statistics(out, dout, lse, dlse, tile_m=64, dq_accum=dq_accum)
    assert (dq_accum == 0).all()
    want = (out.double() * dout.double()).sum(-1) - dlse.double()
    torch.testing.assert_close(delta[..., :113].double(), want, atol=1e-5, rtol=1e-5)
    want_lse2 = torch.where(lse == -math.inf, math.inf, lse.double() * math.log2(math.e))
    torch.testing.assert_close(lse2[..., :113].double(), want_lse2, atol=1e-6, rtol=1e-6)
    assert (lse2[..., 113:] == math.inf).all() and (delta[..., 113:] == 0).all()
    acc = 50 * torch.randn(2, 3, 113, 128, generator=gen).to("cuda")
    dq = dq_from_accumulator(acc, q, 0.125)
    assert dq.stride() == q.stride() and torch.equal(dq, (acc.double() * 0.125).to(torch_dtype))


def table_twin(head_dim: int, causal: bool, **fields):
    """The table's tile for (head_dim, causal) with template options ``fields`` set (a twin that
    benchmarks/sweep_bwd_sm90.py --twin times), checked valid."""
    tile = dataclasses.replace(bwd_variants.table_tile(head_dim, masked=causal)[0], **fields)
    assert bwd_variants.check(tile, head_dim) == []
    return tile


# the table's tile of each kernel head dim and of a padded one (96), masked and not: where an option's twins are tested
OPTION_HEAD_DIMS = [(d, masked) for d in (*bwd_variants.KERNEL_HEAD_DIMS, 96) for masked in (False, True)]


# k_first (K loaded ahead of the first query block's Q, V after it, on a barrier of its own), a template option
# benchmarks/sweep_bwd_sm90.py --twin k_first times: the table's tile of each kernel head dim with it
K_FIRST = [(d, masked) for d in bwd_variants.KERNEL_HEAD_DIMS for masked in (False, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, causal", K_FIRST, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_k_first_load_order_matches_fp64(shape, head_dim, causal, dtype, gen):
    check_gradients(shape, dtype, head_dim, causal, gen, tile=table_twin(head_dim, causal, k_first=True))


# split_loops (each query head's masked and unmasked query blocks in loops of their own; the producer and dQ warp's
# loops nested), a template option benchmarks/sweep_bwd_sm90.py --twin split_loops times: the table's tile of each
# kernel head dim with it (GQA shapes among SHAPES: more than one query head per loop), and its deterministic kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, causal", OPTION_HEAD_DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_loops_match_fp64(shape, head_dim, causal, dtype, gen):
    check_gradients(shape, dtype, head_dim, causal, gen, tile=table_twin(head_dim, causal, split_loops=True))


@pytest.mark.parametrize("head_dim, causal", [(64, True), (128, False), (128, True)], ids=lambda x: str(x))
def test_split_loops_deterministic_repeats_bit_for_bit(head_dim, causal, gen):
    check_gradients((2, 6, 2, 1023, 1023), "bf16", head_dim, causal, gen, deterministic=True,
                    tile=table_twin(head_dim, causal, split_loops=True))


# longest_first (a causal kernel's key blocks started longest first across sections of kv heads: a 1-D grid decoded
# into key block, kv head and batch), a template option benchmarks/sweep_bwd_sm90.py --twin longest_first=N times: the
# table's causal tile of each kernel head dim and a padded one with sections of 3 (kv head, batch) pairs, which leave
# SHAPES' 2, 4 and 8 pairs a part-filled last section; a CTA decoded twice or never leaves dQ, dK or dV wrong
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (*bwd_variants.KERNEL_HEAD_DIMS, 96))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_longest_first_matches_fp64(shape, head_dim, dtype, gen):
    check_gradients(shape, dtype, head_dim, True, gen, tile=table_twin(head_dim, True, longest_first=3))


# persistent (one CTA per SM running key blocks in turn, each claimed from a tile counter; dK and dV staged in dS's
# buffer while the next tile's K and V load), a template option benchmarks/sweep_bwd_sm90.py --twin persistent times:
# the masked-call tile of d=64, d=128 and a padded head dim (96) with it, causal and not, on SHAPES and on more tiles
# than the GPU has SMs, launched on every SM and on 3 CTAs (each then runs tens of tiles: a tile run twice or never,
# or a handoff out of step, leaves dQ, dK or dV wrong or NaN)
PERSISTENT = [(d, causal) for d in (64, 128, 96) for causal in (False, True)]


@pytest.mark.parametrize("ctas", (None, 3), ids=("every-sm", "3-ctas"))
@pytest.mark.parametrize("head_dim, causal", PERSISTENT, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", [*SHAPES, (4, 8, 2, 1500, 2500)], ids=lambda s: "x".join(map(str, s)))
def test_persistent_matches_fp64(shape, head_dim, causal, ctas, gen, monkeypatch):
    from attnforge.backends.cute_sm90 import backward

    if ctas is not None:
        monkeypatch.setattr(backward, "max_ctas", lambda device: ctas)
    check_gradients(shape, "bf16", head_dim, causal, gen, tile=table_twin(head_dim, True, persistent=True))


# try_wait_first (the consumers' waits for Q and dO a try-wait, then the wait), a template option
# benchmarks/sweep_bwd_sm90.py --twin try_wait_first times: the d=64 and d=128 table tiles with it
@pytest.mark.parametrize("head_dim, causal", [(d, m) for d in (64, 128) for m in (False, True)], ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_try_wait_first_matches_fp64(shape, head_dim, causal, gen):
    check_gradients(shape, "bf16", head_dim, causal, gen, tile=table_twin(head_dim, causal, try_wait_first=True))


# flat_dq (dQ staged in the accumulator's register order and added by a 1-D bulk reduce-add, the conversion undoing
# the order: backward.FlatDqOrder), a template option benchmarks/sweep_bwd_sm90.py --twin flat_dq times: the table's
# tile of each kernel head dim with it, each way of splitting dQ (rows at d=64, columns at d=128 masked and d=256,
# transposed at d=128 unmasked), a padded head dim (96) and the deterministic kernel too
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, causal", OPTION_HEAD_DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flat_dq_matches_fp64(shape, head_dim, causal, dtype, gen):
    check_gradients(shape, dtype, head_dim, causal, gen, tile=table_twin(head_dim, causal, flat_dq=True))


@pytest.mark.parametrize("head_dim, causal", [(64, True), (128, False), (128, True)], ids=lambda x: str(x))
def test_flat_dq_deterministic_repeats_bit_for_bit(head_dim, causal, gen):
    check_gradients((2, 6, 2, 1023, 1023), "bf16", head_dim, causal, gen, deterministic=True,
                    tile=table_twin(head_dim, causal, flat_dq=True))

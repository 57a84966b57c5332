"""The host side of cute_sm90's backward, with no GPU: the row statistics its kernel loads, its table's one
validity check, and what plan_backward says for problems it does not serve."""

import dataclasses
import math
import pathlib

import pytest
import torch

from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.backends.cute_sm90.backward import row_statistics
from attnforge import explain
from attnforge.dispatch.select import clear_caches
from attnforge.testing import run_interpreter_tests


def test_row_statistics_are_log2_lse_and_delta_padded_to_whole_blocks(gen):
    out, dout = (torch.randn(2, 3, 17, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 3, 17, generator=gen)
    lse[0, 1, 4] = -math.inf  # a row that saw no key
    dlse = torch.randn(2, 3, 17, generator=gen)
    lse2, delta = row_statistics(out, dout, lse, dlse, tile_m=64)
    assert lse2.shape == delta.shape == (2, 3, 64) and lse2.dtype == delta.dtype == torch.float32
    expected = lse * math.log2(math.e)
    expected[0, 1, 4] = math.inf  # P = exp2(s - inf) = 0 for that row
    torch.testing.assert_close(lse2[..., :17], expected)
    torch.testing.assert_close(delta[..., :17], (dout.double() * out.double()).sum(-1).float() - dlse)
    assert (lse2[..., 17:] == math.inf).all() and (delta[..., 17:] == 0).all()  # padding rows: P 0, no delta


def test_row_statistics_keep_nan():
    out = torch.full((1, 1, 3, 8), float("nan"), dtype=torch.float16)
    lse2, delta = row_statistics(out, torch.ones_like(out), torch.zeros(1, 1, 3), None, tile_m=128)
    assert delta[..., :3].isnan().all() and lse2.shape == (1, 1, 128)


@pytest.mark.parametrize("unmasked_only_served", (False, True))
def test_the_table_passes_its_own_check(monkeypatch, unmasked_only_served):
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", unmasked_only_served)
    for head_dim, tiles in bwd_variants.BWD.items():
        assert all(bwd_variants.check(tile, head_dim) == [] for tile in tiles)
        masked = [tile for tile in tiles if not tile.unmasked_only][0]  # every head dim has one for masks
        unmasked = tiles[0] if unmasked_only_served or not tiles[0].unmasked_only else masked
        assert bwd_variants.table_tile(head_dim, masked=False) == (tiles[0], [])
        assert bwd_variants.pick(head_dim, masked=False) == (unmasked, [])
        assert bwd_variants.pick(head_dim, masked=True) == (masked, [])


def test_head_dims_run_the_next_kernel_up():
    assert [bwd_variants.kernel_head_dim(d) for d in (8, 64, 72, 128, 136, 256)] == [64, 64, 128, 128, 256, 256]
    for head_dim in bwd_variants.HEAD_DIMS:
        tile, why = bwd_variants.table_tile(head_dim, masked=False)
        assert (tile, why) == (bwd_variants.BWD[bwd_variants.kernel_head_dim(head_dim)][0], [])
        assert tile.params(head_dim)["head_dim_padded"] == bwd_variants.kernel_head_dim(head_dim) >= head_dim
    for head_dim in (4, 100, 264):
        assert bwd_variants.pick(head_dim, masked=True) == (None, [f"head_dim {head_dim} has no cute_sm90 backward "
                                                                   "(has every multiple of 8 up to 256)"])


def test_padding_serves_every_head_dim_and_turned_off_says_so(monkeypatch):
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", True)
    assert all(bwd_variants.pick(d, masked=m) == bwd_variants.table_tile(d, masked=m)
               for d in bwd_variants.HEAD_DIMS for m in (False, True))
    monkeypatch.setattr(bwd_variants, "PADDED_SERVED", False)
    assert bwd_variants.pick(80, masked=True) == (None, [bwd_variants.PADDED_REASON])
    assert bwd_variants.pick(128, masked=True) == bwd_variants.table_tile(128, masked=True)


def test_d128_takes_80_rows_without_a_mask_and_64_with_one(monkeypatch):
    """FlashAttention-3/4's choice at d=128, which the table holds: served (UNMASKED_ONLY_SERVED), the planner and
    the build take the 80-row tile (unmasked_only) for unmasked calls, the next entry for causal or windowed ones,
    and say why; not served, the 64-row tile for all."""
    from attnforge.backends.cute_sm90.backward import Sm90BwdVariant
    from attnforge.dispatch.registry import get

    rows80, masked_tile = bwd_variants.BWD[128]
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", False)
    assert bwd_variants.pick(128, masked=False) == bwd_variants.pick(96, masked=False) == (masked_tile, [])
    assert bwd_variants.table_tile(128, masked=False) == (rows80, [])  # (what the GPU tests run)
    monkeypatch.setattr(bwd_variants, "UNMASKED_ONLY_SERVED", True)
    assert (rows80.tile_m, rows80.dq_transposed, rows80.unmasked_only) == (80, True, True)
    assert (masked_tile.tile_m, masked_tile.unmasked_only) == (64, False)
    assert bwd_variants.pick(128, masked=False) == (rows80, [])
    assert bwd_variants.pick(96, masked=False) == (rows80, [])  # (the padded head dims on the 128 kernel too)
    assert bwd_variants.pick(128, masked=True) == (masked_tile, [])
    assert bwd_variants.mask_reasons(rows80, True) == [
        "the 80x128 s2 2 consumer warpgroups, dK/dV by TMA, dQ transposed, dQ staged flat tile serves calls without a "
        "causal mask or window only"]
    assert rows80.module(128) == dataclasses.replace(rows80, unmasked_only=False).module(128)  # the same kernel
    shape = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=1000, heads=8, needs_grad=True,
                 backend="cute_sm90")
    assert explain(causal=False, **shape).backward.variant.tile == rows80
    assert explain(causal=True, **shape).backward.variant.tile == masked_tile
    assert explain(causal=False, window_size=(256, 0), **shape).backward.variant.tile == masked_tile  # (a window masks)
    built = {(v.causal, v.window, v.tile) for v in get("cute_sm90").variants(dtypes=("bf16",), head_dims=(128,),
                                                                               features=(frozenset({"window"}),))
             if isinstance(v, Sm90BwdVariant)}
    assert built == {(False, False, rows80), (True, False, masked_tile), (False, True, masked_tile),
                     (True, True, masked_tile)}


def test_a_tile_turned_off_says_so(monkeypatch):
    monkeypatch.setattr(bwd_variants, "SPLIT_HEAD_DIM_SERVED", False)
    assert bwd_variants.table_tile(256, masked=True) == (bwd_variants.BWD[256][0], [])
    assert bwd_variants.pick(256, masked=True) == (None, [bwd_variants.SPLIT_HEAD_DIM_REASON])


def test_the_head_dim_256_tile_fits_and_splits_the_head_dim():
    tile = bwd_variants.BWD[256][0]
    assert tile.split_head_dim and tile.consumer_warpgroups == 2 and (tile.tile_m, tile.tile_n) == (64, 64)
    assert tile.smem_bytes(256) <= bwd_variants.SMEM_BYTES
    assert tile.registers_needed(256) <= tile.consumer_registers
    # two stages of Q and dO do not fit beside K, V, the dS and P^T stages and dQ's staging buffers
    assert any("shared memory" in r for r in bwd_variants.check(dataclasses.replace(tile, q_stages=2), 256))


@pytest.mark.parametrize(("tile", "head_dim", "reason"), [
    (bwd_variants.Sm90BwdTile(64), 100, "head_dim 100 has no cute_sm90 backward"),
    (bwd_variants.Sm90BwdTile(64, tile_n=64), 128, "tile_n 64 != 128"),
    (bwd_variants.Sm90BwdTile(96), 128, "tile_m 96 is not 64 or 128"),
    (bwd_variants.Sm90BwdTile(64), 64, "splits dQ's 64 columns into 32"),
    (bwd_variants.Sm90BwdTile(128, q_stages=3), 128, "shared memory"),
    (bwd_variants.Sm90BwdTile(128), 128, "registers per consumer thread"),
    (bwd_variants.Sm90BwdTile(64, tile_n=128, split_head_dim=True), 256, "split_head_dim takes 64 x 64 tiles"),
    (bwd_variants.Sm90BwdTile(64, tile_n=64, q_stages=1, split_head_dim=True), 64, "not a multiple of the 128-byte"),
    (bwd_variants.Sm90BwdTile(64, tile_n=64, q_stages=1, split_head_dim=True), 40, "not a multiple of the 128-byte"),
])
def test_check_names_what_does_not_fit(tile, head_dim, reason):
    assert any(reason in r for r in bwd_variants.check(tile, head_dim)), bwd_variants.check(tile, head_dim)


@pytest.mark.parametrize(("kw", "reason"), [
    (dict(head_dim=256, softcap=30.0), bwd_variants.SPLIT_HEAD_DIM_FEATURES_REASON),
    (dict(head_dim=256, window_size=(100, 0)), bwd_variants.SPLIT_HEAD_DIM_FEATURES_REASON),
    (dict(head_dim=192, alibi=True), bwd_variants.SPLIT_HEAD_DIM_FEATURES_REASON),  # 192 runs the 256 kernel
])
def test_a_forced_backend_says_why_its_backward_cannot_serve(kw, reason, monkeypatch):
    """Forcing cute_sm90 for training where its backward does not serve (its head-dim-256 feature forms turned
    off): the next backward runs, and says why."""
    monkeypatch.setattr(bwd_variants, "SPLIT_HEAD_DIM_FEATURES_SERVED", False)
    d = explain(device="H100", dtype="bf16", seqlen_q=512, needs_grad=True, backend="cute_sm90", **kw)
    assert d.forward.backend == "cute_sm90" and d.backward.backend not in (None, "cute_sm90")
    assert any(reason in r for r in d.backward.reasons_of("cute_sm90")), d.backward.reasons_of("cute_sm90")


@pytest.mark.parametrize("kw", [dict(head_dim=256, softcap=30.0), dict(head_dim=192, window_size=(100, 0))])
def test_the_head_dim_256_backward_serves_its_feature_forms(kw):
    d = explain(device="H100", dtype="bf16", seqlen_q=512, needs_grad=True, backend="cute_sm90", **kw)
    assert d.backward.backend == "cute_sm90" and "splitting the head dim" in str(d), str(d)


def test_a_forced_training_call_shows_its_backward_in_the_decision():
    d = explain(device="H200", dtype="bf16", head_dim=128, seqlen_q=2048, heads=8, needs_grad=True,
                backend="cute_sm90")
    assert d.backward.backend == "cute_sm90" and not d.fallback
    assert f"bwd {bwd_variants.pick(128, masked=False)[0].describe()}" in str(d)


def test_row_and_dq_kernels_in_the_interpreter():
    """The Triton kernels before and after the backward kernel (interpreter/test_bwd_rows_interpreted.py)."""
    run_interpreter_tests(pathlib.Path(__file__).parent / "interpreter" / "test_bwd_rows_interpreted.py")


def flat_tiles():
    """Each kernel head dim's table tiles with flat_dq, those its check passes (one per way of splitting dQ)."""
    tiles = [(dataclasses.replace(tile, flat_dq=True), d) for d, table in bwd_variants.BWD.items() for tile in table]
    return [(tile, d) for tile, d in tiles if not bwd_variants.check(tile, d)]


def wgmma_share_order(order):
    """FlatDqOrder's map built the long way, thread by thread from the sm90 WGMMA accumulator layout (lane l of warp w
    holds rows 16 w + l // 4 (+ 8) and columns 8 j + 2 (l % 4) (+ 1) of each 64 x N tile, in register order (a, b, j)),
    each thread's registers stored four at a time at 512 (i // 4) + 4 t + i % 4 of its warpgroup's share."""
    index = torch.full((order.tile_m, order.width), -1, dtype=torch.long)
    along_n = {"rows": order.width, "columns": order.width // order.warpgroups, "transposed": order.tile_m}[order.split]
    for share in range(order.warpgroups if order.split != "rows" else order.tile_m // 64):
        for t in range(128):
            warp, lane = divmod(t, 32)
            for j in range(along_n // 8):
                for b in range(2):
                    for a in range(2):
                        m, n = 16 * warp + lane // 4 + 8 * b, 8 * j + 2 * (lane % 4) + a
                        i = a + 2 * b + 4 * j
                        at = share * 64 * along_n + 512 * (i // 4) + 4 * t + i % 4
                        if order.split == "rows":
                            index[64 * share + m, n] = at
                        elif order.split == "columns":
                            index[m, along_n * share + n] = at
                        else:
                            index[n, 64 * share + m] = at
    return index


@pytest.mark.parametrize("tile, head_dim", flat_tiles(), ids=lambda x: getattr(x, "tile_m", x))
def test_the_flat_dq_order_is_the_wgmma_accumulator_order(tile, head_dim):
    from attnforge.backends.cute_sm90.backward import FlatDqOrder

    order = FlatDqOrder.of(tile, head_dim)
    rows, cols = torch.arange(order.tile_m)[:, None], torch.arange(order.width)[None, :]
    closed_form = order.offsets(rows, cols)
    assert torch.equal(closed_form, wgmma_share_order(order))
    assert torch.equal(closed_form.flatten().sort().values, torch.arange(order.tile_m * order.width))  # one to one


def test_every_split_of_dq_has_a_flat_tile():
    from attnforge.backends.cute_sm90.backward import FlatDqOrder

    assert {FlatDqOrder.of(tile, d).split for tile, d in flat_tiles()} == set(FlatDqOrder.SPLITS)


@pytest.mark.parametrize("seqlen", (1, 17, 113))
@pytest.mark.parametrize("head_dim", (40, 64, 128, 256))
def test_dq_from_a_flat_accumulator_undoes_its_order(seqlen, head_dim, gen):
    from attnforge.backends.cute_sm90.backward import FlatDqOrder, dq_from_flat_accumulator

    for tile, d in flat_tiles():
        if d != bwd_variants.kernel_head_dim(head_dim):
            continue
        order = FlatDqOrder.of(tile, head_dim)
        q = torch.randn(2, 3, seqlen, head_dim, generator=gen).to(torch.bfloat16)
        acc, dq_rows = order.accumulator(q), torch.randn(2, 3, order.tile_m * -(-seqlen // order.tile_m),
                                                         order.width, generator=gen)
        rows = torch.arange(acc.shape[2])
        index = (rows // order.tile_m * order.tile_m * order.width)[:, None] + order.offsets(
            (rows % order.tile_m)[:, None], torch.arange(order.width)[None, :])
        acc.view(2, 3, -1)[..., index.flatten()] = dq_rows.view(2, 3, -1)  # the kernel's layout of dq_rows
        dq = dq_from_flat_accumulator(acc, q, 0.5, order)
        assert torch.equal(dq, (dq_rows[:, :, :seqlen, :head_dim] * 0.5).to(torch.bfloat16))


def test_a_flat_dq_tile_takes_no_packed_batch():
    tile, _ = flat_tiles()[0]
    assert bwd_variants.feature_reasons(tile, window=False, varlen=True, softcap=False, alibi=False)
    assert not bwd_variants.feature_reasons(tile, window=True, varlen=False, softcap=True, alibi=True)


@pytest.mark.parametrize("served", (True, False), ids=("features-served", "features-not-served"))
@pytest.mark.parametrize("features", [{}, {"window_size": (256, 0)}, {"softcap": 30.0}, {"varlen": True}],
                         ids=("plain", "window", "softcap", "varlen"))
def test_flat_dq_serves_dense_calls_and_packed_ones_take_the_tiled_twin(features, served, monkeypatch, request):
    """The table's d=64/128 tiles stage dQ flat; a packed batch, and with FLAT_DQ_FEATURES_SERVED off a window or
    softcap, run the same tile with dQ through the swizzled tile, and the build compiles that one for them."""
    monkeypatch.setattr(bwd_variants, "FLAT_DQ_FEATURES_SERVED", served)
    clear_caches()
    request.addfinalizer(clear_caches)  # (before the flag is restored: no Decision made with it outlives the test)
    assert all(tile.flat_dq for d in (64, 128) for tile in bwd_variants.BWD[d])
    tile = bwd_variants.BWD[64][0]
    flags = dict(window="window_size" in features, varlen="varlen" in features, softcap="softcap" in features,
                 alibi=False)
    twin = bwd_variants.staging_for(tile, **flags)
    tiled = "varlen" in features or (bool(features) and not served)
    assert twin == (dataclasses.replace(tile, flat_dq=False) if tiled else tile)
    assert not bwd_variants.feature_reasons(twin, **flags)
    if "varlen" not in features:
        shape = dict(device="H100", dtype="bf16", head_dim=64, seqlen_q=1000, heads=8, needs_grad=True,
                     backend="cute_sm90", causal=True)
        assert explain(**shape, **features).backward.variant.tile == twin

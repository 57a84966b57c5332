"""The split-KV heuristic (variants.kv_splits): splits cover every key in whole key steps, an asked count is kept,
and the H200 serving shapes get the split counts the sweep behind the heuristic measured fastest."""

import pytest

from attnforge.backends.triton_fa2 import variants
from attnforge.backends.triton_rocm import variants as rocm_variants


@pytest.mark.parametrize("ctas,longest,block_n,asked,paged", [
    (512, 8192, 128, 0, False), (8, 8192, 128, 0, False), (8, 8192, 128, 0, True), (128, 32768, 128, 0, True),
    (3, 1, 64, 0, False), (3, 0, 64, 0, True), (2, 1000, 64, 7, False), (2, 100, 64, 9, False), (1, 5000, 32, 0, True),
    (1, 1 << 20, 128, 1000, False)])
def test_splits_cover_the_keys_in_whole_steps(ctas, longest, block_n, asked, paged):
    splits, per_split = variants.kv_splits(ctas, longest, block_n, 132, asked, paged)
    assert per_split % block_n == 0 and per_split > 0 and 1 <= splits <= variants.MAX_SPLITS
    assert splits * per_split >= longest and (splits - 1) * per_split < max(longest, 1)
    if asked:
        assert splits <= asked


def sm90_occupancy(paged: bool) -> int:
    """CTAs per SM of the sm90 d=128 decode tile (4 packed rows: GQA 32/8), contiguous or paged."""
    table = variants.KVCACHE_PAGED if paged else variants.KVCACHE
    tile, _ = variants.kv_tile(table, "sm90", 128, 4)
    return variants.kv_ctas_per_multiprocessor(tile, "sm90", 128)


def test_the_sm90_decode_tiles_run_one_cta_per_sm_contiguous_and_three_paged():
    """What the split rule's one wave counts at d=128 on sm90: the contiguous tile's 3 stages of 128-key K and V
    (128 KB of shared memory) leave room for one CTA per SM, the paged tile's 2 stages for three."""
    assert (sm90_occupancy(False), sm90_occupancy(True)) == (1, 3)


@pytest.mark.parametrize("ctas,longest,paged,expected", [
    (512, 8192, False, 1), (128, 32768, False, 1), (8, 8192, False, 16),  # batch 64 / 8k, 16 / 32k, 1 / 8k
    (512, 8192, True, 8), (128, 32768, True, 32), (8, 8192, True, 32)])
def test_the_h200_shapes_get_the_measured_split_counts(ctas, longest, paged, expected):
    """benchmarks/results/2026-12-01-h200-kvcache: contiguous caches fastest unsplit when the CTAs about fill the
    132 SMs, batch 1 at 16 splits; paged caches at about 4096 CTAs, and batch 1 paged at 32 splits (25.6 us against
    28.5 at 16, the w4 s2 tile replayed from a graph)."""
    assert variants.kv_splits(ctas, longest, 128, 132, paged=paged,
                              ctas_per_multiprocessor=sm90_occupancy(paged))[0] == expected


@pytest.mark.parametrize("batch,paged,expected", [
    (1, False, 16), (2, False, 8), (4, False, 4), (8, False, 2), (12, False, 1),
    (1, True, 32), (2, True, 16), (4, True, 8), (8, True, 4), (12, True, 4)])
def test_small_batches_split_within_one_wave(batch, paged, expected):
    """benchmarks/results/2026-12-07-h100-decode-splits (8k keys, GQA 32/8, 8 CTAs per sequence, 132 SMs): the split
    count measured fastest at each batch, contiguous and paged. The largest power of two whose CTAs fit one wave,
    where filling every SM had rounded up into a second, partial wave."""
    assert variants.kv_splits(8 * batch, 8192, 128, 132, paged=paged,
                              ctas_per_multiprocessor=sm90_occupancy(paged))[0] == expected


@pytest.mark.parametrize("module", [variants, rocm_variants], ids=["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64, 1000])
def test_every_arch_and_head_dim_has_a_kv_tile_for_any_row_count(module, rows):
    """Decode (a few rows) and chunked prefill (many) find a tile that passes the validity check everywhere, paged
    or not: a tile too large for the row count's block_m is cut down, never refused."""
    for table in (module.KVCACHE, module.KVCACHE_PAGED):
        for arch in table:
            for head_dim in variants.KV_HEAD_DIMS:  # the table's head dims and every multiple of 8 between them
                tile, why = variants.kv_tile(table, arch, head_dim, rows)
                assert tile is not None, (arch, head_dim, rows, why)
                assert tile.block_m <= max(16, 1 << (rows - 1).bit_length()) and not variants.check(tile, arch, head_dim)


def test_a_head_dim_between_the_tables_takes_the_next_ones_tile_and_others_are_refused_with_why():
    table = variants.KVCACHE
    assert variants.KV_HEAD_DIMS == tuple(range(16, 257, 8))
    assert [variants.kv_table_dim(table["sm90"], d) for d in (16, 40, 80, 96, 136, 200, 256)] == [32, 64, 96, 96, 192,
                                                                                                   256, 256]
    for arch in table:
        assert variants.kv_tile(table, arch, 80, 1)[0] == variants.kv_tile(table, arch, 96, 1)[0]
        assert variants.kv_tile(table, arch, 200, 1)[0] == variants.kv_tile(table, arch, 256, 1)[0]
    for head_dim in (8, 12, 84, 264):
        tile, why = variants.kv_tile(table, "sm90", head_dim, 1)
        assert tile is None and why == [f"head_dim {head_dim} has no KV-cache tile (has every multiple of 8 from 16 "
                                        "to 256)"]


def test_decode_at_head_dim_80_plans_the_kvcache_kernel_on_every_gpu_family():
    """A paged decode at head dim 80 (OPT-2.7B, Phi-2) runs the KV-cache kernel, not the reference's gathers."""
    import attnforge

    for device, backend in (("H100", "triton_fa2"), ("A100", "triton_fa2"), ("MI300X", "triton_rocm")):
        decision = attnforge.explain(device=device, dtype="bf16", head_dim=80, seqlen_q=1, seqlen_k=8192, heads=32,
                                     kv_heads=8, batch=8, kv_cache="paged")
        assert decision.forward.backend == backend and decision.forward.variant.head_dim == 80, decision

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


@pytest.mark.parametrize("ctas,longest,paged,expected", [
    (512, 8192, False, 1), (128, 32768, False, 1), (8, 8192, False, 16),  # batch 64 / 8k, 16 / 32k, 1 / 8k
    (512, 8192, True, 8), (128, 32768, True, 32), (8, 8192, True, 16)])
def test_the_h200_shapes_get_the_measured_split_counts(ctas, longest, paged, expected):
    """benchmarks/results/2026-12-01-h200-kvcache: contiguous caches fastest unsplit when the CTAs about fill the
    132 SMs, batch 1 at 16 splits; paged caches at about 4096 CTAs."""
    assert variants.kv_splits(ctas, longest, 128, 132, paged=paged)[0] == expected


@pytest.mark.parametrize("module", [variants, rocm_variants], ids=["triton_fa2", "triton_rocm"])
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64, 1000])
def test_every_arch_and_head_dim_has_a_kv_tile_for_any_row_count(module, rows):
    """Decode (a few rows) and chunked prefill (many) find a tile that passes the validity check everywhere, paged
    or not: a tile too large for the row count's block_m is cut down, never refused."""
    for table in (module.KVCACHE, module.KVCACHE_PAGED):
        for arch, dims in table.items():
            for head_dim in dims:
                tile, why = variants.kv_tile(table, arch, head_dim, rows)
                assert tile is not None, (arch, head_dim, rows, why)
                assert tile.block_m <= max(16, 1 << (rows - 1).bit_length()) and not variants.check(tile, arch, head_dim)

"""The split-KV heuristic (variants.kv_splits): splits cover every key in whole key steps, an asked count is kept,
and the H200 serving shapes get the split counts the sweep behind the heuristic measured fastest."""

import pytest

from attnforge.backends.triton_fa2 import variants


@pytest.mark.parametrize("ctas,longest,block_n,asked,paged", [
    (512, 8192, 128, 0, False), (8, 8192, 128, 0, False), (8, 8192, 128, 0, True), (128, 32768, 128, 0, True),
    (3, 1, 64, 0, False), (3, 0, 64, 0, True), (2, 1000, 64, 7, False), (2, 100, 64, 9, False), (1, 5000, 32, 0, True)])
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

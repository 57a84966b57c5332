"""The sm90 variant table and its one validity check."""

import pytest

from attnforge.backends.cute_sm90 import variants
from attnforge.backends.cute_sm90.variants import Sm90FwdTile, check


@pytest.mark.parametrize("kind", variants.KINDS)
def test_every_head_dim_has_a_valid_pick(kind):
    for head_dim in variants.HEAD_DIMS:
        tile, reasons = variants.pick(kind, head_dim)
        assert tile is not None and not reasons and not check(tile, head_dim, kind)
    assert [(k, d) for k, d, _ in variants.picks()] == [(k, d) for k in variants.KINDS for d in variants.HEAD_DIMS]


def test_fp8_needs_32_key_blocks():
    assert any("FP8 needs tile_n a multiple of 32" in r for r in check(Sm90FwdTile(128, 80), 128, "fp8"))
    assert not check(Sm90FwdTile(128, 80), 128, "16bit")


@pytest.mark.parametrize(("tile", "head_dim", "needle"), [
    (Sm90FwdTile(128, 128, 4), 256, "KiB of shared memory, sm90 has 227 KiB"),
    (Sm90FwdTile(192, 128), 128, "tile_m must be 64 x consumer warpgroups"),
    (Sm90FwdTile(128, 72), 128, "tile_n must be a multiple of 16"),
    (Sm90FwdTile(64, 128, consumer_warpgroups=1), 128, "pingpong needs two or more"),
    (Sm90FwdTile(192, 128, consumer_warpgroups=3, consumer_registers=240), 64, "registers per CTA > 65536"),
    (Sm90FwdTile(128, 256, consumer_registers=160), 128, "registers per consumer thread, has 160"),
    (Sm90FwdTile(128, 128, cluster=(2, 1)), 128, "clusters are not implemented"),
    (Sm90FwdTile(128, 128), 96, "head_dim 96 has no cute_sm90 kernel"),
])
def test_check_names_what_is_wrong(tile, head_dim, needle):
    assert any(needle in r for r in check(tile, head_dim)), check(tile, head_dim)


def test_module_names_are_distinct_and_describe_the_tile():
    names = {t.module(d, k) for k, d, t in variants.picks()}
    assert len(names) == len(variants.picks())
    assert "fwd_16bit_d256_m128_n64_s2_wg2_pp" in names


def test_persistent_shows_in_the_names():
    tile = Sm90FwdTile(128, 128, persistent=True)
    assert tile.module(128).endswith("_pp_ps") and tile.describe().endswith(" persistent")

"""benchmarks/timeline_cute_sm90.py instruments a rendered variant by text patches that must each apply
exactly once: kept in step with the template here, on CPU (no compile)."""

import pathlib

import pytest

from attnforge.backends.cute_sm90.variants import WG2, WG3, Sm90FwdTile
from attnforge.codegen.render import render
from attnforge.runtime.generated import import_path

SCRIPT = pathlib.Path(__file__).parents[3] / "benchmarks" / "timeline_cute_sm90.py"


@pytest.mark.skipif(not SCRIPT.is_file(), reason="benchmarks/ is not part of an installed package")
@pytest.mark.parametrize(("tile", "kind"), [(Sm90FwdTile(128, 128, 2, **WG2), "fp8"), (Sm90FwdTile(128, 128, 2, **WG2), "16bit"),
                                            (Sm90FwdTile(192, 96, 2, **WG3), "fp8")])
def test_timeline_patches_apply_to_the_template(tile, kind):
    timeline = import_path(SCRIPT)
    source = timeline.patch(render("cute_sm90_fwd.py.jinja", **tile.params(128, kind)), trace_m=3, trace_h=1)
    compile(source, "patched", "exec")  # still Python
    assert source.count("self.trace(mLSE, trace_base, n_block,") == 9 + 4  # nine consumer points, four producer ones
    assert "mLSE[row, head, batch] = lse[r]" not in source  # the LSE tensor holds the trace


BWD_SCRIPT = SCRIPT.with_name("timeline_bwd_sm90.py")


# a CTA's entry (and the dQ warp's end) are written once per CTA, or with the persistent option once per tile, from
# the per-tile code; every other event from one place
PER_TILE_TOO = ("sm", "entry_ns", "entry", "dq_end")


# the served tiles, and the persistent twins of those that take it (d=64, d=128's masked-call tile)
TIMELINE_TILES = [(d, masked, False) for d in (64, 128, 256) for masked in (False, True)] + [
    (d, masked, True) for d in (64, 128) for masked in (False, True)]


@pytest.mark.skipif(not BWD_SCRIPT.is_file(), reason="benchmarks/ is not part of an installed package")
@pytest.mark.parametrize("head_dim, masked, persistent", TIMELINE_TILES, ids=str)
def test_backward_timeline_patches_apply_to_the_served_tiles(head_dim, masked, persistent):
    import dataclasses

    from attnforge.backends.cute_sm90 import backward, bwd_variants

    timeline = import_path(BWD_SCRIPT)
    tile, reasons = bwd_variants.pick(head_dim, masked=masked or persistent)
    assert tile is not None, reasons
    if persistent:
        tile = dataclasses.replace(tile, persistent=True)
        assert bwd_variants.check(tile, head_dim) == []
    source = timeline.patch(backward.Sm90BwdVariant(tile, head_dim, "bf16", masked).source.text())
    compile(source, "patched", "exec")  # still Python
    for name, event in timeline.EVENTS.items():
        written = source.count(f"mdQorder[trace_n * {timeline.SLOTS} + {event}, ")
        assert written == (2 if name in PER_TILE_TOO else 1), (name, written)
    assert f"mdQorder.iterator + {timeline.SLOTS - 1})" in source  # the tile counter, clear of the events

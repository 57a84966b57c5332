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


@pytest.mark.skipif(not BWD_SCRIPT.is_file(), reason="benchmarks/ is not part of an installed package")
@pytest.mark.parametrize("masked", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_timeline_patches_apply_to_the_served_tiles(head_dim, masked):
    from attnforge.backends.cute_sm90 import backward, bwd_variants

    timeline = import_path(BWD_SCRIPT)
    tile, reasons = bwd_variants.pick(head_dim, masked=masked)
    assert tile is not None, reasons
    source = timeline.patch(backward.Sm90BwdVariant(tile, head_dim, "bf16", masked).source.text())
    compile(source, "patched", "exec")  # still Python
    for event in timeline.EVENTS.values():  # every slot is written, each from one place
        assert source.count(f"mdQorder[trace_n * {timeline.SLOTS} + {event}, ") == 1, event

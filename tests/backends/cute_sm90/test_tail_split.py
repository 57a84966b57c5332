"""Tail splitting (backends/cute_sm90/tail_split.py) on CPU: the plans, the arguments run_kernel hands a
kernel, and the combine kernel in Triton's interpreter (its file in interpreter/, a process of its own). The split
kernels themselves run in test_gpu.py."""

import math
import pathlib

import numpy
import pytest
import torch
import triton
from packaging.version import Version

from attnforge.backends.cute_sm90 import tail_split, variants
from attnforge.backends.cute_sm90.backend import run_kernel
from attnforge.testing import run_interpreter_tests

SPLIT_TILES = [(kind, d, t) for kind, d, t in variants.picks() if t.tail_split]


@pytest.mark.parametrize("sms", (1, 7, 132))
@pytest.mark.parametrize("key_blocks", (1, 3, 8, 11, 43, 171))
@pytest.mark.parametrize("tiles", (1, 5, 56, 131, 132, 133, 1376, 1408))
def test_every_plan_is_valid_and_no_slower_by_its_estimate(tiles, key_blocks, sms):
    p = tail_split.plan(tiles, key_blocks, sms)
    assert p.check(tiles, key_blocks) == []
    whole = tail_split.whole(tiles)
    assert tail_split.estimate(p, key_blocks, sms) <= tail_split.estimate(whole, key_blocks, sms)
    if p.pieces > 1:
        assert p.full_tiles % sms == 0 and 0 < p.tail_tiles < sms  # only the part-filled last wave is split
        assert key_blocks // p.pieces >= tail_split.MIN_BLOCKS_PER_PIECE
        assert math.ceil(p.slots / sms) <= tail_split.MAX_PIECE_WAVES  # the workspace stays bounded
        assert tail_split.estimate(p, key_blocks, sms) < (1 - tail_split.MIN_GAIN) * tail_split.estimate(
            whole, key_blocks, sms)
    else:
        assert p == whole


def test_whole_waves_are_not_split_and_the_measured_shape_is():
    """B=1, H=11, N=16128 at 192-row tiles fills 7 waves of 132 SMs exactly; N=16384 with 16 heads (the
    benchmarks' shape) leaves 56 tiles in an 11th wave: they run as two pieces of 85-86 key blocks."""
    assert tail_split.plan(84 * 11, 168, 132) == tail_split.whole(924)
    assert tail_split.plan(86 * 16, 171, 132) == tail_split.Plan(1320, 56, 2)


@pytest.mark.parametrize("tiles,key_blocks", ((8, 3), (5, 1)))
def test_plan_check_names_the_problem(tiles, key_blocks):
    assert tail_split.Plan(tiles - 1, 2, 2).check(tiles, key_blocks)  # counts do not add up
    assert tail_split.Plan(0, tiles, key_blocks + 1).check(tiles, key_blocks)  # a piece with no key block


class RecordingKernel:
    def __call__(self, *args):
        self.args = args


@pytest.mark.skipif(not SPLIT_TILES, reason="no picked cute_sm90 tile has tail_split")
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_run_kernel_hands_the_plan_to_the_kernel(causal, monkeypatch):
    """Arguments after max_ctas: the workspaces, full_tiles, pieces. Causal kernels never split (their tiles
    differ in length); the combine runs exactly when pieces ran."""
    kind, d, tile = SPLIT_TILES[0]
    combined = []
    monkeypatch.setattr(tail_split, "combine", lambda *a, **kw: combined.append(a[0]))
    b, h, nq, nk = 1, 2, 3 * tile.tile_m, 20 * tile.tile_n  # 6 tiles of 20 key blocks
    q = torch.empty(b, h, nq, d)
    k = torch.empty(b, h, nk, d)
    kernel = RecordingKernel()
    ran = run_kernel(kernel, tile, q, k, k, q, torch.empty(b, h, nq), 1.0, causal=causal, ctas=4)
    o_part, lse_part, full_tiles, pieces = kernel.args[-4:]
    assert kernel.args[-5] == 4
    if causal:
        assert ran == tail_split.whole(6) and (full_tiles, pieces) == (6, 1) and not combined
    else:  # 4 SMs: one wave of 4 whole tiles, then 2 tiles as pieces
        assert ran == tail_split.plan(6, 20, 4) and ran.pieces > 1 and (full_tiles, pieces) == (4, ran.pieces)
        assert o_part.shape == (2 * ran.pieces, tile.tile_m, d) and lse_part.shape == (2 * ran.pieces, tile.tile_m)
        assert combined == [ran]


@pytest.mark.skipif(not SPLIT_TILES, reason="no picked cute_sm90 tile has tail_split")
@pytest.mark.parametrize("plan,causal", (((4, 1, 2), False), ((5, 0, 1), False), ((0, 6, 21), False), ((4, 2, 2), True)),
                         ids=("counts", "whole-count", "more-pieces-than-blocks", "causal"))
def test_run_kernel_refuses_a_plan_that_cannot_run(plan, causal):
    """A given plan is checked against the call (6 tiles of 20 key blocks) before anything launches."""
    kind, d, tile = SPLIT_TILES[0]
    q, k = torch.empty(1, 2, 3 * tile.tile_m, d), torch.empty(1, 2, 20 * tile.tile_n, d)
    kernel = RecordingKernel()
    with pytest.raises(ValueError, match="tail split plan"):
        run_kernel(kernel, tile, q, k, k, q, torch.empty(1, 2, 3 * tile.tile_m), 1.0, causal=causal, ctas=4,
                   plan=tail_split.Plan(*plan))
    assert not hasattr(kernel, "args")


@pytest.mark.skipif(Version(triton.__version__) < Version("3.8") and Version(numpy.__version__) >= Version("2.4"),
                    reason="Triton < 3.8's interpreter fails on range() with a runtime bound (the combine's loop over "
                           "pieces) under numpy >= 2.4 (as in tests/backends/triton_fa2/test_interpreter_suite.py)")
def test_combine_kernel_in_the_interpreter():
    run_interpreter_tests(pathlib.Path(__file__).parent / "interpreter" / "test_tail_split_combine_interpreted.py")

import json

import pytest
import torch

from attnforge import explain
from attnforge.backends.triton_fa2 import autotune, variants
from attnforge.cli import main


@pytest.fixture
def winners(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path))
    variants.clear_tuned()

    def write(arch, doc):
        autotune.winners_path(arch).write_text(json.dumps(doc))
        variants.clear_tuned()
    yield write
    variants.clear_tuned()


def test_persisted_winner_is_picked_and_shown(winners):
    table_pick, _ = variants.pick(variants.FWD, "sm80", 128)
    other = next(t for t in autotune.candidates("fwd", "sm80", 128) if t != table_pick)
    winners("sm80", {"fwd": {"128": other.params()}, "bwd": {}})
    assert variants.pick(variants.FWD, "sm80", 128) == (other, [])
    assert variants.pick(variants.FWD, "sm80", 128, tuned=False) == (table_pick, [])
    assert variants.pick(variants.FWD, "sm80", 64)[0] == variants.pick(variants.FWD, "sm80", 64, tuned=False)[0]
    d = explain(device="A100", dtype="bf16", head_dim=128, seqlen_q=1024)
    assert d.forward.variant.tile == other and d.forward.variant.tuned
    assert d.forward.describe().startswith(f"{other.describe()} (tuned)")
    assert not explain(device="A100", dtype="bf16", head_dim=64, seqlen_q=1024).forward.variant.tuned


def test_winners_that_fail_the_check_are_ignored(winners):
    table_pick, _ = variants.pick(variants.FWD, "sm86", 128, tuned=False)
    too_big = variants.FwdTile(256, 256, 4, 4)  # fails check() (shared memory, registers)
    assert variants.check(too_big, "sm86", 128)
    winners("sm86", {"fwd": {"128": too_big.params()}})
    assert variants.pick(variants.FWD, "sm86", 128) == (table_pick, [])
    winners("sm86", {"fwd": {"128": {"block_m": 64, "bogus": 1}}})  # another version's format
    assert variants.pick(variants.FWD, "sm86", 128) == (table_pick, [])


def test_a_winner_no_table_lists_is_rendered_into_the_cache_and_runs_from_there(winners, tmp_path):
    """Generated modules are build outputs: a persisted winner that passes check() need not be a tile of
    any table (nothing is committed to be missing); the planned variant renders it into the cache on use."""
    unlisted = variants.FwdTile(64, 16, 4, 2)
    assert not variants.check(unlisted, "sm86", 128)
    assert unlisted not in autotune.candidates("fwd", "sm86", 128)
    winners("sm86", {"fwd": {"128": unlisted.params()}})
    assert variants.pick(variants.FWD, "sm86", 128) == (unlisted, [])
    variant = explain(device="A10", dtype="bf16", head_dim=128, seqlen_q=1024).forward.variant
    assert variant.tile == unlisted and variant.tuned
    assert variant.module.VARIANT_NAME == unlisted.module and callable(variant.module.launch)
    (rendered,) = (tmp_path / "generated").glob(f"{unlisted.module}-*.py")
    assert rendered.read_text() == variant.source.text()


def test_candidates_are_the_tables_tiles_that_pass_the_check_and_render():
    fwd, bwd = variants.all_tiles()
    for family, tiles in (("fwd", fwd), ("bwd", bwd)):
        found = autotune.candidates(family, "sm90", 128)
        assert found and found == [t for t in tiles if variants.check(t, "sm90", 128) == []]
        for tile in found:
            module = autotune._module(tile)  # rendered into the cache and imported from there
            assert module.VARIANT_NAME == tile.module and callable(module.launch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `attnforge tune` really tunes (run_gpu.sh runs it)")
def test_tune_needs_a_gpu(capsys):
    assert main(["tune"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("doc", [[], None, 42, "x", {"fwd": "x"}, {"fwd": []}, {"fwd": {"128": "x"}},
                                 {"fwd": {"128": None}}, {"fwd": {"128": [64, 64]}},
                                 {"fwd": {"128": {"block_m": "64", "block_n": 64, "num_warps": 4, "num_stages": 2}}},
                                 {"fwd": {"128": {"block_m": 64, "block_n": 64, "num_warps": 0, "num_stages": 2}}},
                                 {"fwd": {"128": {"block_m": 64, "block_n": 64, "num_warps": 3, "num_stages": 2}}},
                                 {"fwd": {"128": {"block_m": 64, "block_n": 64, "num_warps": True, "num_stages": 2}}},
                                 {"fwd": {"128": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2,
                                                  "loads": "tma"}}},
                                 {"fwd": {"128": {"block_m": 64.0, "block_n": 64, "num_warps": 4, "num_stages": 2}}}],
                         ids=repr)
def test_winners_files_of_any_other_shape_are_ignored(winners, doc):
    """The winners file is data: valid JSON of another shape, or values the tile cannot compute with
    (num_warps 0 divides by zero in registers(); an unknown loads has no module name), means no winner."""
    table_pick, _ = variants.pick(variants.FWD, "sm80", 128, tuned=False)
    winners("sm80", doc)
    assert variants.tuned_tile("fwd", "sm80", 128) is None
    assert variants.pick(variants.FWD, "sm80", 128) == (table_pick, [])
    assert explain(device="A100", dtype="bf16", head_dim=128, seqlen_q=1024).forward.variant.tile == table_pick


def test_saved_winners_are_readable_by_all(winners, tmp_path):
    import os
    old = os.umask(0o077)
    try:
        path = autotune.save({"arch": "sm80", "fwd": {}, "bwd": {}}, tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644

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
    assert d.forward.variant.startswith(f"{other.describe()} (tuned); ")


def test_winners_that_fail_the_check_or_were_not_rendered_are_ignored(winners):
    table_pick, _ = variants.pick(variants.FWD, "sm86", 128, tuned=False)
    too_big = variants.FwdTile(256, 256, 4, 4)  # fails check() (shared memory, registers)
    unrendered = variants.FwdTile(64, 16, 4, 2)
    assert variants.check(too_big, "sm86", 128) and not variants.check(unrendered, "sm86", 128)
    for tile in (too_big, unrendered):
        winners("sm86", {"fwd": {"128": tile.params()}})
        assert variants.pick(variants.FWD, "sm86", 128) == (table_pick, [])
    winners("sm86", {"fwd": {"128": {"block_m": 64, "bogus": 1}}})  # another version's format
    assert variants.pick(variants.FWD, "sm86", 128) == (table_pick, [])


def test_candidates_are_rendered_tiles_that_pass_the_check():
    for family in ("fwd", "bwd"):
        for tile in autotune.candidates(family, "sm90", 128):
            assert variants.check(tile, "sm90", 128) == [] and tile.module in variants._rendered()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `attnforge tune` really tunes (run_gpu.sh runs it)")
def test_tune_needs_a_gpu(capsys):
    assert main(["tune"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err

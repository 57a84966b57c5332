"""attention() and generated modules with a cache that cannot be used: a read-only or broken cache folder,
or an ATTNFORGE_CACHE_DIR that is empty: the call works, from this process's scratch folder, with one
warning, and nothing is written into the working directory."""

import logging

import pytest
import torch

import attnforge
from attnforge.codegen import Source
from attnforge.dispatch import selfcheck
from attnforge.runtime import cache, generated
from attnforge.testing import oracle, rel_error


@pytest.fixture
def unusable(tmp_path, monkeypatch):
    """A cache folder that cannot be created (its parent is a file): every write fails with an OSError."""
    (tmp_path / "file").write_text("in the way")
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    generated.forget()
    cache.forget_warnings()
    selfcheck.clear()
    yield tmp_path
    generated.forget()
    selfcheck.clear()


def _source():
    from attnforge.backends.triton_fa2 import variants

    tile = variants.pick(variants.FWD, "sm80", 64, tuned=False)[0]
    return Source.of("triton_fa2_fwd.py.jinja", tile.params(), tile.module)


def test_generated_modules_go_to_the_scratch_folder_with_one_warning(unusable, caplog):
    pytest.importorskip("triton", reason="triton is not installed")
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        module = generated.load(_source())
        path = generated.path_for(_source())
    assert path.parent.parent == cache.scratch_dir() and path.read_text() == _source().text()
    assert callable(module.launch)
    warnings = [r.getMessage() for r in caplog.records if "generated kernel modules go to" in r.getMessage()]
    assert len(warnings) == 1 and str(unusable / "file") in warnings[0], warnings


def test_an_explicit_folder_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(cache.CacheError, match=str(tmp_path / "file")):
        generated.path_for(Source.of("triton_fa2_fwd.py.jinja", _source().params, "x"), tmp_path / "file" / "out")


def test_generated_modules_are_not_imported_from_a_folder_others_can_write(tmp_path, monkeypatch, caplog):
    import os

    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path))
    cache.forget_warnings()
    path = generated.path_for(_source())
    assert path.parent.parent == tmp_path
    os.chmod(tmp_path / "generated", 0o777)
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        assert generated.path_for(_source()).parent.parent == cache.scratch_dir()
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)


def test_attention_works_with_an_unusable_cache(unusable, gen):
    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen) for _ in range(3))
    out = attnforge.attention(q, k, v, causal=True)
    assert rel_error(out, oracle(q, k, v, causal=True)[0]) < 1e-5
    assert attnforge.last_decision().forward.backend == "sdpa"


def test_an_empty_cache_dir_is_not_the_working_directory(tmp_path, monkeypatch, gen):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    selfcheck.clear()
    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen) for _ in range(3))
    out = attnforge.attention(q, k, v)
    assert rel_error(out, oracle(q, k, v)[0]) < 1e-5
    assert list(tmp_path.iterdir()) == []  # nothing written (or loaded) from the working directory
    selfcheck.clear()

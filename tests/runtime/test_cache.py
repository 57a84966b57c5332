"""The cache folder: where it is (``~`` expanded; empty or relative refused), what it may be trusted for
(owned by this user or root, writable by no one else), the permissions of what is written into it, and
errors that name the path."""

import os
import pathlib

import pytest

from attnforge.errors import AttnforgeError
from attnforge.runtime import cache


def test_tilde_is_expanded(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", "~/somewhere/attnforge")
    assert cache.default_cache_dir() == pathlib.Path.home() / "somewhere" / "attnforge"


def test_unset_is_the_user_cache(monkeypatch):
    monkeypatch.delenv("ATTNFORGE_CACHE_DIR")
    assert cache.default_cache_dir() == pathlib.Path.home() / ".cache" / "attnforge"


@pytest.mark.parametrize("value", ["", " ", "relative/cache", ".", "~user-that-does-not-exist-xyz/c"])
def test_an_empty_or_relative_cache_dir_is_refused(monkeypatch, value):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", value)
    with pytest.raises(cache.CacheError, match="ATTNFORGE_CACHE_DIR") as caught:
        cache.default_cache_dir()
    assert isinstance(caught.value, OSError) and isinstance(caught.value, AttnforgeError)


def test_written_files_and_folders_have_the_documented_modes(tmp_path):
    old = os.umask(0o077)  # a private umask must not make a shared cache unreadable
    try:
        cache.write_atomic(tmp_path / "a" / "b" / "file", b"x")
        with cache.locked(tmp_path / "c" / "locks" / "k.lock"):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "b" / "file").stat().st_mode & 0o777 == cache.FILE_MODE == 0o644
    for folder in ("a", "a/b", "c", "c/locks"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == cache.DIR_MODE == 0o755, folder


def test_write_errors_name_the_path(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(cache.CacheError, match=str(tmp_path / "file")):
        cache.write_atomic(tmp_path / "file" / "entry", b"x")
    with pytest.raises(cache.CacheError, match=str(tmp_path / "file")):
        with cache.locked(tmp_path / "file" / "locks" / "k.lock"):
            pass


def test_trust(tmp_path):
    entry = tmp_path / "sub" / "kernel.o"
    entry.parent.mkdir(mode=0o755)
    entry.write_bytes(b"x")
    os.chmod(tmp_path, 0o755)
    os.chmod(entry, 0o644)
    assert cache.untrusted(entry, tmp_path) is None
    assert cache.untrusted(tmp_path / "missing.o", tmp_path) is None
    os.chmod(entry.parent, 0o775)
    assert "writable by group or others (mode 0775)" in cache.untrusted(entry, tmp_path)
    os.chmod(entry.parent, 0o755)
    os.chmod(tmp_path, 0o757)
    assert str(tmp_path) in cache.untrusted(entry, tmp_path)
    os.chmod(tmp_path, 0o755)
    if os.geteuid() == 0:  # giving a file away needs root
        os.chown(entry, 12345, -1)
        assert "owned by uid 12345" in cache.untrusted(entry, tmp_path)


def test_warnings_are_logged_once(caplog):
    cache.forget_warnings()
    with caplog.at_level("WARNING", logger="attnforge"):
        cache.warn_once("the same thing")
        cache.warn_once("the same thing")
    assert [r.getMessage() for r in caplog.records] == ["the same thing"]  # the logger is named attnforge: no prefix of its own

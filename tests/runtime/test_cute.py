"""CuTe kernels exported to the cache are loaded only when they match the content record written beside
them and the folders are trusted; anything else is rebuilt (build) or compiled in memory (attention),
never raising for the cache's sake. Compiling is faked here: the checks are about the files."""

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from attnforge.runtime import cache, cute

try:
    importlib.metadata.version("nvidia-cutlass-dsl")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("nvidia-cutlass-dsl is not installed (pip install 'attnforge[cute]')", allow_module_level=True)

OBJECT = b"\x7fELF a compiled kernel, as far as these tests know" * 20


class FakeCompiled:
    """What cute.compile returns, as far as export() uses it."""

    def export_to_c(self, object_file_path, function_name):
        with open(object_file_path, "wb") as f:
            f.write(OBJECT)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A build whose compile and load are stand-ins: compile counts, load returns the bytes it found."""
    module = tmp_path / "module.py"
    module.write_text("# a rendered module\n")
    root = tmp_path / "cache"
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(root))
    compiles, loads = [], []
    monkeypatch.setattr(cute, "can_compile_here", lambda arch: True)
    monkeypatch.setattr(cute, "compile_kernel", lambda build, **kw: compiles.append(build) or FakeCompiled())
    monkeypatch.setattr(cute, "load", lambda path, root=None: loads.append(path) or ("loaded", path.read_bytes()))
    cache.forget_warnings()
    cute.forget()
    build = cute.CuteBuild(str(module), "module", "bf16", True, "sm_90a", "cute_test", "x:y")
    yield build, root, compiles, loads
    cute.forget()


def test_export_writes_a_content_record_beside_the_object(fake):
    build, root, compiles, _ = fake
    path, now = cute.build_cached(build, root)
    assert now and path.read_bytes() == OBJECT
    record = json.loads(cute.record_path(path).read_text())
    assert record["bytes"] == len(OBJECT) and len(record["sha256"]) == 64
    assert cute.check_object(path) is None
    assert path.stat().st_mode & 0o777 == 0o644 and cute.record_path(path).stat().st_mode & 0o777 == 0o644
    assert cute.build_cached(build, root) == (path, False) and len(compiles) == 1


@pytest.mark.parametrize("damage", ["same-size garbage", "truncated", "no record", "record is []",
                                    "record is null", "record of other bytes"])
def test_a_bad_object_is_rebuilt_by_build_and_never_loaded(fake, caplog, damage):
    build, root, compiles, loads = fake
    path, _ = cute.build_cached(build, root)
    record = cute.record_path(path)
    {"same-size garbage": lambda: path.write_bytes(b"\0" * len(OBJECT)),
     "truncated": lambda: path.write_bytes(OBJECT[:10]),
     "no record": lambda: record.unlink(),
     "record is []": lambda: record.write_text("[]"),
     "record is null": lambda: record.write_text("null"),
     "record of other bytes": lambda: record.write_text(json.dumps({"bytes": len(OBJECT), "sha256": "0" * 64})),
     }[damage]()
    assert cute.check_object(path) is not None
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        assert cute.build_cached(build, root) == (path, True)  # rebuilt, not "cached"
    assert any("rebuilding the CuTe kernel" in r.getMessage() for r in caplog.records)
    assert cute.check_object(path) is None and len(compiles) == 2
    assert loads == []


def test_attention_path_compiles_in_memory_for_a_garbage_object_in_a_read_only_cache(fake, caplog):
    """The run-time path: a garbage .o is not loaded, and a cache that cannot be written (its lock folder
    is a file here; a read-only folder for a non-root user) costs a compile and a warning, no exception."""
    build, root, compiles, loads = fake
    path, _ = cute.build_cached(build, root)
    path.write_bytes(b"\0" * len(OBJECT))
    (path.parent / "locks").rename(path.parent / "locks.old")
    (path.parent / "locks").write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        fn = cute.compiled(build)
    assert isinstance(fn, FakeCompiled) and loads == [] and len(compiles) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"not loading the CuTe kernel {path}" in m for m in messages)
    assert any("not kept for the next process" in m for m in messages)
    assert path.read_bytes() == b"\0" * len(OBJECT)  # left as it was: nothing could be written


def test_a_good_object_is_loaded_and_a_foreign_writable_folder_is_not(fake, caplog):
    build, root, compiles, loads = fake
    path, _ = cute.build_cached(build, root)
    assert cute.compiled(build) == ("loaded", OBJECT) and len(compiles) == 1
    cute.forget()
    os.chmod(path.parent, 0o777)
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        fn = cute.compiled(build)
    assert isinstance(fn, FakeCompiled) and len(loads) == 1 and len(compiles) == 2
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)


def test_a_bad_cache_dir_compiles_in_memory(fake, monkeypatch):
    build, root, compiles, loads = fake
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", "relative")
    assert isinstance(cute.compiled(build), FakeCompiled) and loads == []


def test_build_into_a_cache_that_cannot_be_written_names_the_path(fake, tmp_path):
    build, _, _, _ = fake
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(cache.CacheError, match=str(tmp_path / "file")) as caught:
        cute.build_cached(build, tmp_path / "file" / "cache")
    assert isinstance(caught.value, OSError)


LOAD_IN_CHILD = """
import sys, pathlib
from attnforge.runtime import cute
fn = cute.load(pathlib.Path(sys.argv[1]))
print(type(fn).__name__, "cutlass" in sys.modules)
"""


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                    reason="no C compiler to link a kernel's shared library")
def test_a_built_kernel_gets_a_shared_library_that_loads_without_the_cute_dsl(tmp_path):
    """build links <key>.so beside <key>.o and records it; by default (or ATTNFORGE_CUTE_SHARED=1) a fresh process loads the
    kernel through TVM FFI without importing the CuTe DSL; a library that does not match its record is not loaded
    (the object is, through the DSL)."""
    from attnforge.backends.cute_sm90 import variants
    from attnforge.backends.cute_sm90.backend import Sm90Variant

    tile, _ = variants.pick("16bit", 64)
    path, built = cute.build_cached(Sm90Variant(tile, "16bit", 64, "bf16", False).build, tmp_path)
    assert built and cute.shared_path(path).is_file() and cute.check_shared(path) is None
    assert cute.shared_path(path).stat().st_mode & 0o777 == 0o644
    env = {name: value for name, value in os.environ.items() if name != cute.SHARED_ENV}  # the default: on

    def child(extra=None):
        done = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD, str(path)], capture_output=True, text=True,
                              env={**env, **(extra or {})}, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    assert child() == ["Function", "False"]
    assert child({cute.SHARED_ENV: "1"}) == ["Function", "False"]
    assert child({cute.SHARED_ENV: "0"}) == ["Function", "True"]  # off: the object, JIT-linked by the DSL
    data = bytearray(cute.shared_path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    cute.shared_path(path).write_bytes(bytes(data))
    assert "does not match" in cute.check_shared(path)
    assert child() == ["Function", "True"]


@pytest.mark.parametrize("value,on", [("1", True), ("", True), ("2", True), ("0", False), (" OFF ", False),
                                      ("false", False), ("no", False)])
def test_shared_loading_is_on_unless_turned_off(monkeypatch, value, on):
    monkeypatch.setenv(cute.SHARED_ENV, value)
    assert cute.shared_loading() is on
    monkeypatch.delenv(cute.SHARED_ENV)
    assert cute.shared_loading()

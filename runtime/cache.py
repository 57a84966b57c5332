"""The attnforge cache folder, per-key file locks and atomic writes.

Everything attnforge writes to disk (rendered kernel modules, compiled kernels, self-check records,
tuned tiles) lives under one folder: ``$ATTNFORGE_CACHE_DIR``, else ``~/.cache/attnforge``. Writers
hold a per-key lock and publish by rename, so a reader sees no entry or a whole one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile

CACHE_ENV = "ATTNFORGE_CACHE_DIR"


def default_cache_dir() -> pathlib.Path:
    """``$ATTNFORGE_CACHE_DIR``, else ``~/.cache/attnforge``."""
    return pathlib.Path(os.environ.get(CACHE_ENV, pathlib.Path.home() / ".cache" / "attnforge"))


@contextlib.contextmanager
def locked(path: pathlib.Path):
    """An exclusive advisory lock on the file ``path`` (created with its folder) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_atomic(path: pathlib.Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` by a rename (a reader sees no file or a whole one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # mkstemp makes it private; a deployment's cache is read by its users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""The attnforge cache folder, per-key file locks, atomic writes, and the checks made before loading code.

Everything attnforge writes to disk (rendered kernel modules, compiled kernels, self-check records,
tuned tiles) lives under one folder: ``$ATTNFORGE_CACHE_DIR`` with ``~`` expanded, else
``~/.cache/attnforge``. An empty or relative ``ATTNFORGE_CACHE_DIR`` is refused (``CacheError`` names
it), not resolved: a relative folder moves with the working directory, and an empty one made the
working directory itself the place native code is loaded from. Writers hold a per-key lock and
publish by rename, so a reader sees no entry or a whole one.

Permissions: folders 0755, files 0644, whatever the umask: writable by the owner alone, readable by
all, so a cache filled by root (a container image, a shared deployment) serves every user.

Trust: a binary (a Triton cubin, a CuTe ``.o``) or a generated module is loaded only when the file and
every folder from the cache root down to it are owned by this user or by root and writable by no one
else (``untrusted``), as pip and Triton require of their caches; otherwise the kernel is compiled in
memory and a warning is logged once.

Failures: creating, locking or writing in the cache raises ``CacheError`` (an ``OSError`` and an
``AttnforgeError``) naming the path. ``attention()`` catches it and runs from memory and a private
temporary folder (``scratch_dir``) with one warning; ``attnforge build`` reports it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import pathlib
import shutil
import stat
import tempfile
import threading

from ..errors import AttnforgeError

CACHE_ENV = "ATTNFORGE_CACHE_DIR"
DIR_MODE, FILE_MODE = 0o755, 0o644
logger = logging.getLogger("attnforge")


class CacheError(AttnforgeError, OSError):
    """The cache folder cannot be used as asked: a bad ``ATTNFORGE_CACHE_DIR``, or a file or folder in it
    that cannot be created, locked or written. The message names the path."""


def default_cache_dir() -> pathlib.Path:
    """``$ATTNFORGE_CACHE_DIR`` (``~`` expanded; it must be an absolute path), else ``~/.cache/attnforge``."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return pathlib.Path.home() / ".cache" / "attnforge"
    path = pathlib.Path(os.path.expanduser(value))
    if not value.strip() or not path.is_absolute():
        raise CacheError(f"{CACHE_ENV}={value!r} is not an absolute path: set it to an absolute folder "
                         f"(or unset it for ~/.cache/attnforge)")
    return path


def _error(what: str, path, exc: OSError) -> CacheError:
    if isinstance(exc, CacheError):
        return exc
    error = CacheError(f"cannot {what} {path}: {exc.strerror or exc}")
    error.errno = exc.errno
    return error


def make_dirs(path: pathlib.Path) -> None:
    """Create the folder ``path`` and any missing parents, each DIR_MODE."""
    path = pathlib.Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(exist_ok=True)
            if folder.stat().st_uid == os.geteuid():
                os.chmod(folder, DIR_MODE)  # the umask would decide otherwise
        except OSError as exc:
            raise _error("create the folder", folder, exc) from exc


@contextlib.contextmanager
def locked(path: pathlib.Path):
    """An exclusive advisory lock on the file ``path`` (created with its folder) for the block."""
    path = pathlib.Path(path)
    make_dirs(path.parent)
    try:
        lock = open(path, "a")
    except OSError as exc:
        raise _error("create the lock file", path, exc) from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_atomic(path: pathlib.Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``path`` by a rename (a reader sees no file or a whole one)."""
    path = pathlib.Path(path)
    make_dirs(path.parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # mkstemp makes it private
        os.replace(tmp, path)
    except OSError as exc:
        raise _error("write", path, exc) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _chain(path: pathlib.Path, root: pathlib.Path) -> list[pathlib.Path]:
    """``root``, each folder below it down to ``path``, and ``path``."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return [path]
    chain = [root]
    for part in parts:
        chain.append(chain[-1] / part)
    return chain


def untrusted(path: pathlib.Path, root: pathlib.Path) -> str | None:
    """Why code at ``path`` (inside the cache folder ``root``) must not be loaded, or None: the file or a
    folder from ``root`` down to it is owned by someone other than this user or root, or is writable by
    group or others. A missing file is not judged here (None)."""
    me = os.geteuid()
    for p in _chain(pathlib.Path(path), pathlib.Path(root)):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"{p} cannot be inspected ({exc.strerror or exc})"
        if st.st_uid not in (me, 0):
            return f"{p} is owned by uid {st.st_uid}, neither this user ({me}) nor root"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{p} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning("%s", message)


_scratch: list[pathlib.Path] = []


def scratch_dir() -> pathlib.Path:
    """A private folder of this process (0700, removed at exit) for what the cache cannot take."""
    with _warned_lock:
        if not _scratch:
            folder = pathlib.Path(tempfile.mkdtemp(prefix="attnforge-"))
            atexit.register(shutil.rmtree, folder, True)
            _scratch.append(folder)
        return _scratch[0]


def forget_warnings() -> None:
    """Forget which warnings were logged (tests)."""
    with _warned_lock:
        _warned.clear()

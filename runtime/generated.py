"""Generated kernel modules as build outputs: a template rendered with a variant's parameters into the
cache (``<cache>/generated/<name>-<digest>.py``, the digest being that of the rendered text) and imported
from there. Rendering is deterministic, so the same variant always lands in the same file; a file that
does not hash to its name is data gone bad and is written anew."""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import threading

from .cache import CacheError, default_cache_dir, locked, scratch_dir, untrusted, warn_once, write_atomic

_lock = threading.Lock()
_modules: dict[tuple, object] = {}  # (Source, folder) -> module, per process


_texts: dict[object, str] = {}  # codegen.Source -> its rendered text, per process


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path_for(source, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Where the module a codegen.Source renders to lives in the cache, written there (and checked) if need
    be. A default cache that cannot take it (read-only, a bad ATTNFORGE_CACHE_DIR, or one that
    cache.untrusted refuses to import code from) gives way to this process's scratch folder, with a warning
    logged once; an explicit ``cache_dir`` that cannot raises CacheError."""
    text = _texts.get(source)
    if text is None:
        text = _texts[source] = source.text()
    if cache_dir is not None:
        return _placed(pathlib.Path(cache_dir), source.name, text)
    try:
        return _placed(default_cache_dir(), source.name, text)
    except OSError as exc:  # CacheError included
        warn_once(f"generated kernel modules go to {scratch_dir()} for this process: {exc}")
        return _placed(scratch_dir(), source.name, text)


def _placed(root: pathlib.Path, name: str, text: str) -> pathlib.Path:
    folder = root / "generated"
    path = folder / f"{name}-{digest(text)}.py"
    why = untrusted(path, root)
    if why:
        raise CacheError(f"{why}: attnforge imports no code from there")
    if _intact(path, text):
        return path
    with locked(folder / "locks" / f"{path.stem}.lock"):
        if not _intact(path, text):
            write_atomic(path, text.encode())
    return path


def _intact(path: pathlib.Path, text: str) -> bool:
    try:
        return path.read_bytes() == text.encode()
    except OSError:
        return False


def load(source, cache_dir: pathlib.Path | None = None):
    """The module a codegen.Source renders to, imported once per process from the cache."""
    key = (source, str(cache_dir) if cache_dir is not None else _default_name())
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                path = path_for(source, cache_dir)
                module = _modules[key] = import_path(path, source.name)
    return module


def _default_name() -> str:
    try:
        return str(default_cache_dir())
    except OSError:
        return ""


def import_path(path, name: str | None = None):
    """The Python file ``path`` imported as a module of its own, named ``name`` (default: the file's stem).
    It is registered in sys.modules under a private name: tools that look a function's module up there
    (dataclasses, pickling in worker processes, tracebacks) then find it."""
    path = pathlib.Path(path)
    unique = f"attnforge._kernels.{path.stem.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(unique, None)
        raise
    module.VARIANT_NAME = name or path.stem
    return module


def forget() -> None:
    """Forget the modules this process imported (tests that change the cache folder)."""
    _modules.clear()

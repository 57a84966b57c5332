"""Compiling and caching the generated cute_sm100 kernels: cute_sm90's machinery (compile.py there)
for sm_100a. The CuTe DSL fixes its target arch when it is imported, so a process that already
compiles for sm_90a (a CI run of both, say) builds these in a child process with CUTE_DSL_ARCH=sm_100a.

    python -m attnforge.backends.cute_sm100.compile MODULE DTYPE CAUSAL CACHE_DIR   (what that child runs)
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pathlib
import sys
import threading

from ..._version import __version__
from ...codegen.build import _locked, default_cache_dir
from ..cute_sm90 import compile as sm90

ARCH = "sm_100a"
GENERATED = f"{__package__}._generated"
DTYPES = ("fp16", "bf16")

_compiled: dict[tuple, object] = {}
_lock = threading.Lock()


def kernel_module(module: str):
    sm90.target(ARCH)
    return importlib.import_module(f"{GENERATED}.{module}")


def compile_kernel(module: str, dtype: str, causal: bool, dump_dir: str | None = None):
    """cute.compile one variant for sm_100a in this process (which must be set up for sm_100a)."""
    sm90.import_cutlass(ARCH)
    import cutlass.cute as cute

    mod = kernel_module(module)
    element, out_element = sm90.elements(dtype, ARCH)
    options = f"--enable-tvm-ffi --gpu-arch {ARCH}"
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)  # the DSL writes nothing, silently, into a missing directory
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return cute.compile(mod.Forward(element, out_element, causal), *sm90.fake_arguments(dtype, mod.HEAD_DIM, ARCH),
                        options=options)


def compile_in_child(module: str, dtype: str, causal: bool, dump_dir: str) -> None:
    """compile_kernel in a fresh process set up for sm_100a, keeping PTX and cubin in ``dump_dir``."""
    code = (f"from attnforge.backends.cute_sm100 import compile as c; "
            f"c.compile_kernel({module!r}, {dtype!r}, {causal!r}, dump_dir={dump_dir!r})")
    _child(code)


def _child(code: str) -> None:
    sm90._child(code, ARCH)


def cache_path(module: str, dtype: str, causal: bool, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    from importlib.metadata import version

    source = pathlib.Path(kernel_module(module).__file__).read_bytes()
    h = hashlib.sha256()
    for part in (__version__, version("nvidia-cutlass-dsl"), ARCH, module, dtype, str(causal)):
        h.update(part.encode() + b"\0")
    h.update(source)
    return pathlib.Path(cache_dir or default_cache_dir()) / "cute_sm100" / f"{h.hexdigest()[:32]}.o"


def build_cached(module: str, dtype: str, causal: bool, cache_dir: pathlib.Path | None = None) -> tuple[pathlib.Path, bool]:
    """Compile and export one variant into the cache unless it is there (in a child process when this one
    compiles for another arch). Returns (path, built_now)."""
    path = cache_path(module, dtype, causal, cache_dir)
    with _locked(path.parent / "locks" / f"{path.stem}.lock"):
        if path.is_file() and path.stat().st_size:
            return path, False
        if ("cutlass" in sys.modules and not sm90.arch_ready(ARCH)) or os.environ.get("CUTE_DSL_ARCH", ARCH) != ARCH:
            _child(f"from attnforge.backends.cute_sm100 import compile as c; import pathlib; "
                   f"c.sm90.export(c.compile_kernel({module!r}, {dtype!r}, {causal!r}), pathlib.Path({str(path)!r}))")
        else:
            sm90.export(compile_kernel(module, dtype, causal), path)
        return path, True


def compiled(module: str, dtype: str, causal: bool):
    """The callable kernel: from memory, else the disk cache, else compiled (and exported) now."""
    key = (module, dtype, causal)
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _lock:
        if key not in _compiled:
            sm90.import_cutlass(ARCH)
            path, _ = build_cached(module, dtype, causal)
            _compiled[key] = sm90.load(path)
        return _compiled[key]

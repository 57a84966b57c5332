"""Compiling CuTe-DSL kernels (with no GPU if need be), exporting them to the build cache and loading them.

A ``CuteBuild`` names one kernel as data: the rendered module that defines it, the dtype and causality
it is compiled for, the target arch, the cache folder it belongs in, and a factory (``"module:function"``)
that, given the imported module, returns the kernel object and the fake arguments ``cute.compile`` traces
it with. Fake tensors have symbolic shapes and strides, so one compiled kernel serves every batch, head
count, sequence length and stride. Compiled kernels are exported (``export_to_c``) into
``<cache>/<cache_name>/<key>.o``, keyed by attnforge and CuTe-DSL versions, arch, variant and the module's
source, and later processes load them from there, so a machine compiles each variant once. Kernels are
called through TVM FFI (``--enable-tvm-ffi``): torch tensors go in directly, on the current stream.

An exported ``<key>.o`` is loaded only when the ``<key>.json`` written beside it (after it) records its
size and sha256 and the file matches, and when cache.untrusted finds nothing wrong with the folders;
otherwise the kernel is compiled in memory (and exported anew where the cache can be written), with a
warning logged once.

The CuTe DSL fixes its target arch when ``cutlass`` is first imported: it reads ``CUTE_DSL_ARCH`` then
(nvidia-cutlass-dsl 4.8: EnvironmentVarManager, built at import; with no GPU its own detection picks
sm_100a, on which WGMMA kernels do not build; docs/kernel-notes.md section 8). ``target`` sets the
variable for that import alone and restores it, so the user's environment is left as it was. A process
set up for one arch builds another arch's kernels in a child process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading

from .._version import __version__
from .cache import (FILE_MODE, CacheError, default_cache_dir, locked, make_dirs, scratch_dir, untrusted,
                    warn_once, write_atomic)
from .env import on_unless_turned_off, scoped

logger = logging.getLogger("attnforge")
EXPORTED_NAME = "attnforge_kernel"
SHARED_ENV = "ATTNFORGE_CUTE_SHARED"  # 0 turns off loading kernels from their shared libraries (shared_loading)


@dataclasses.dataclass(frozen=True)
class CuteBuild:
    """One CuTe-DSL kernel of a rendered module, for one dtype and causality, on one arch."""

    path: str  # the rendered module
    module: str  # the variant's module name (listings, cache key)
    dtype: str
    causal: bool
    arch: str  # "sm_90a", "sm_100a"
    cache_name: str  # the cache subfolder (the backend that runs it)
    factory: str  # "package.module:function"; function(module, dtype, causal, arch) -> (kernel, fake arguments)

    def name(self) -> str:
        return f"{self.cache_name} {self.module}.{self.dtype}.{'causal' if self.causal else 'full'}"


_imported_for: list[str] = []  # the CUTE_DSL_ARCH cutlass was imported with, when target() imported it


def target(arch: str) -> None:
    """Import cutlass set up for ``arch``, unless it is imported already or CUTE_DSL_ARCH names another
    arch. The variable is set for the import only: the DSL reads it there and nowhere after."""
    if "cutlass" in sys.modules:
        return
    chosen = os.environ.get("CUTE_DSL_ARCH") or arch
    with scoped("CUTE_DSL_ARCH", chosen):
        import cutlass  # noqa: F401
    _imported_for[:] = [chosen]


def arch_ready(arch: str) -> bool:
    """Whether this process's CuTe DSL compiles for ``arch`` (decided when cutlass was imported)."""
    env = _imported_for[0] if _imported_for else os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env == arch
    import torch

    if torch.cuda.is_available() and torch.version.cuda:
        major, minor = torch.cuda.get_device_capability()
        return arch == f"sm_{major}{minor}a"
    return arch == "sm_100a"  # the DSL's own choice with no GPU


def can_compile_here(arch: str) -> bool:
    """Whether this process's CuTe DSL compiles for ``arch`` (or can still be set up for it)."""
    if "cutlass" in sys.modules:
        return arch_ready(arch)
    return os.environ.get("CUTE_DSL_ARCH") in (None, "", arch)


def import_cutlass(arch: str):
    """Import the CuTe DSL set up for ``arch``; a process already set up for another arch is an error."""
    target(arch)
    import cutlass

    if not arch_ready(arch):
        imported = _imported_for[0] if _imported_for else os.environ.get("CUTE_DSL_ARCH")
        raise RuntimeError(f"the CuTe DSL was imported here for {imported or 'the local GPU'}; "
                           f"these kernels compile for {arch}: set CUTE_DSL_ARCH={arch} before anything imports cutlass")
    return cutlass


def _module(build: CuteBuild):
    target(build.arch)  # the module imports cutlass at its top: imported here first, for the build's arch
    from .generated import import_path

    return import_path(build.path, build.module)


def _factory(build: CuteBuild):
    module, function = build.factory.split(":")
    return getattr(importlib.import_module(module), function)


def compile_kernel(build: CuteBuild, dump_dir: str | None = None, module=None):
    """cute.compile one kernel in this process (works with no GPU). ``dump_dir``: keep its PTX and cubin
    there. ``module``: an already imported module object to compile instead of ``build.path``."""
    import_cutlass(build.arch)
    import cutlass.cute as cute

    kernel, args = _factory(build)(module or _module(build), build.dtype, build.causal, build.arch)
    options = f"--enable-tvm-ffi --gpu-arch {build.arch}"
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)  # the DSL writes nothing, silently, into a missing directory
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return cute.compile(kernel, *args, options=options)


def _in_child(build: CuteBuild, action: str, where: str) -> None:
    """Run ``action`` ("export" to a path, "dump" into a folder) in a fresh process whose CuTe DSL targets
    the build's arch."""
    code = "import sys; from attnforge.runtime import cute; cute._child(sys.argv[1])"
    payload = json.dumps({"build": dataclasses.asdict(build), "action": action, "where": where})
    done = subprocess.run([sys.executable, "-c", code, payload], env=dict(os.environ, CUTE_DSL_ARCH=build.arch),
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"CuTe DSL compile of {build.name()} for {build.arch} failed:\n{done.stderr[-4000:]}")


def _child(payload: str) -> None:
    job = json.loads(payload)
    build = CuteBuild(**job["build"])
    if job["action"] == "export":
        export(compile_kernel(build), pathlib.Path(job["where"]))
    else:
        compile_kernel(build, dump_dir=job["where"])


def compile_to(build: CuteBuild, dump_dir: str) -> None:
    """Compile one kernel keeping its PTX and cubin in ``dump_dir``, in this process if it can, else a child."""
    if can_compile_here(build.arch):
        compile_kernel(build, dump_dir=dump_dir)
    else:
        _in_child(build, "dump", dump_dir)


def export(fn, path: pathlib.Path) -> None:
    """Write a compiled kernel to ``path`` (atomically: a reader sees no file or a whole one)."""
    import tempfile

    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".o")
    os.close(fd)
    try:
        fn.export_to_c(object_file_path=tmp, function_name=EXPORTED_NAME)
        data = pathlib.Path(tmp).read_bytes()
        os.chmod(tmp, FILE_MODE)  # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    shared = link_shared(path)
    # written after the .o (and its .so): a reader that finds the record finds the objects it describes (or newer
    # ones, which fail the check and are rebuilt)
    record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "attnforge": __version__}
    if shared is not None:
        record["shared"] = {"bytes": len(shared), "sha256": hashlib.sha256(shared).hexdigest()}
    write_atomic(record_path(path), json.dumps(record).encode())


def shared_path(path: pathlib.Path) -> pathlib.Path:
    """The shared library linked beside an exported ``<key>.o``: ``<key>.so``."""
    return pathlib.Path(path).with_suffix(".so")


def link_shared(path: pathlib.Path) -> bytes | None:
    """Link the exported object ``path`` into ``<key>.so`` against the CuTe DSL's runtime and TVM FFI libraries
    (their folders as its rpath), so that a process can load the kernel through TVM FFI alone, without importing
    the CuTe DSL (load). Needs a C compiler (``$CC``, else cc or gcc); returns the library's bytes, or None (and
    logs why) where it could not be linked: the object alone serves then."""
    import shutil
    import tempfile

    dsl = sys.modules.get("cutlass.cute")  # (imported by the compile that made the object; not imported here for it)
    if dsl is None:
        logger.debug("no shared library for %s: the CuTe DSL that compiled it is not loaded in this process", path)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    libraries = [lib for lib in dsl.runtime.find_runtime_libraries(enable_tvm_ffi=True) if pathlib.Path(lib).exists()]
    if compiler is None or len(libraries) < 2:
        logger.debug("no shared library for %s: %s", path, "no C compiler" if compiler is None else
                     f"runtime libraries not found ({libraries})")
        return None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".so")
    os.close(fd)
    rpath = ":".join(dict.fromkeys(str(pathlib.Path(lib).parent) for lib in libraries))
    try:
        done = subprocess.run([compiler, "-shared", "-o", tmp, str(path), *libraries, f"-Wl,-rpath,{rpath}"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            logger.debug("no shared library for %s: %s", path, done.stderr.strip()[-500:])
            return None
        data = pathlib.Path(tmp).read_bytes()
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, shared_path(path))
        return data
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("no shared library for %s: %s", path, exc)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def record_path(path: pathlib.Path) -> pathlib.Path:
    """The content record written beside an exported ``<key>.o``: ``<key>.json``."""
    return pathlib.Path(path).with_suffix(".json")


def check_object(path: pathlib.Path) -> str | None:
    """Why the exported object ``path`` must not be loaded (None: it matches its content record)."""
    return _check_recorded(pathlib.Path(path), path, lambda record: record,
                           f"{record_path(path).name} is not a content record", "beside it")


def _check_recorded(data_path: pathlib.Path, path: pathlib.Path, entry_of, no_entry: str, where: str) -> str | None:
    """Why ``data_path`` does not match the entry ``entry_of`` picks from the content record of the object ``path``
    (size and sha256), or None."""
    try:
        record = json.loads(record_path(path).read_text())
        data = data_path.read_bytes()
    except FileNotFoundError as exc:
        return f"{exc.filename} is missing"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    entry = entry_of(record) if isinstance(record, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or type(entry.get("bytes")) is not int:
        return no_entry
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        return f"it does not match the size and sha256 recorded {where}"
    return None


def check_shared(path: pathlib.Path) -> str | None:
    """Why the shared library beside the exported object ``path`` must not be loaded (None: it matches the
    ``shared`` entry of the object's content record)."""
    return _check_recorded(shared_path(path), path, lambda record: record.get("shared"),
                           "the content record has no entry for it", "for it")


def shared_loading() -> bool:
    """Whether load() takes a kernel's shared library through TVM FFI: on unless ``ATTNFORGE_CUTE_SHARED`` is 0,
    false, no or off (any case). No CuTe DSL import: a process's first CuTe call after a build took 0.65 s instead
    of 2.65 s on the H200 (benchmarks/startup.py), with the kernels' results checked against fp64 math on the GPU
    (tests/backends/cute_sm90/test_gpu_shared.py)."""
    return on_unless_turned_off(SHARED_ENV)


def _load_runtime_libraries() -> None:
    # A kernel loaded from an object file resolves the CuTe runtime's symbols through the global
    # namespace; cute.runtime.load_module does not load those libraries RTLD_GLOBAL itself.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if pathlib.Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def load(path: pathlib.Path, root: pathlib.Path | None = None):
    """The callable kernel exported to ``path``: with shared_loading(), from the shared library beside it where that
    matches its record (and, inside the cache folder ``root``, passes its trust check), through TVM FFI alone; else
    the object JIT-linked by the CuTe DSL."""
    if shared_loading() and check_shared(path) is None and (root is None or untrusted(shared_path(path), root) is None):
        try:
            import tvm_ffi

            return tvm_ffi.load_module(str(shared_path(path)))[EXPORTED_NAME]
        except Exception as exc:  # (a library that passed its check but does not load here): the object serves
            logger.debug("loading %s through the CuTe DSL: its shared library does not load (%s: %s)",
                         path, type(exc).__name__, exc)
    import cutlass.cute as cute

    _load_runtime_libraries()
    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), EXPORTED_NAME)


def cache_path(build: CuteBuild, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """<cache>/<cache_name>/<key>.o, the key from attnforge and CuTe-DSL versions, arch, variant and source."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for part in (__version__, version("nvidia-cutlass-dsl"), build.arch, build.module, build.dtype, str(build.causal)):
        h.update(part.encode() + b"\0")
    h.update(pathlib.Path(build.path).read_bytes())
    return pathlib.Path(cache_dir or default_cache_dir()) / build.cache_name / f"{h.hexdigest()[:32]}.o"


def build_cached(build: CuteBuild, cache_dir: pathlib.Path | None = None,
                 keep_asm: bool = False) -> tuple[pathlib.Path, bool]:
    """Compile and export one kernel into the cache unless it is there and matches its content record (in a
    child process when this one's CuTe DSL targets another arch). ``keep_asm``: also keep its PTX, cubin
    and SASS in ``<key>.asm/``. A kernel that is there is found with no write; a bad one is rebuilt, with
    a warning. Returns (path, built_now); raises CacheError naming the path when the cache cannot be written."""
    path = cache_path(build, cache_dir)
    asm_dir = path.with_suffix(".asm")
    if check_object(path) is None and (not keep_asm or asm_dir.is_dir()):
        return path, False
    with locked(path.parent / "locks" / f"{path.stem}.lock"):
        bad = check_object(path)
        if bad is not None:
            if path.exists():
                warn_once(f"rebuilding the CuTe kernel {path}: {bad}")
            _export_here_or_in_child(build, path)
        if keep_asm:
            compile_to(build, str(asm_dir))
            _write_sass(asm_dir)
        return path, True


def _export_here_or_in_child(build: CuteBuild, path: pathlib.Path) -> None:
    try:
        if can_compile_here(build.arch):
            export(compile_kernel(build), path)
        else:
            _in_child(build, "export", str(path))
    except CacheError:
        raise
    except OSError as exc:
        raise CacheError(f"cannot write the CuTe kernel {path}: {exc.strerror or exc}") from exc


def _write_sass(asm_dir: pathlib.Path) -> None:
    from .triton_aot import sass

    for cubin in asm_dir.glob("*.cubin"):
        cubin.with_suffix(".sass").write_text(sass(cubin.read_bytes()))


_compiled: dict[CuteBuild, object] = {}
_lock = threading.Lock()


def compiled(build: CuteBuild):
    """The callable kernel: from this process's memory, else from the disk cache, else compiled now (and
    exported for the next process). Thread-safe."""
    fn = _compiled.get(build)
    if fn is not None:
        return fn
    with _lock:
        if build not in _compiled:
            _compiled[build] = _load_or_compile(build)
        return _compiled[build]


def _load_or_compile(build: CuteBuild):
    """The exported kernel when the cache has a good and trusted one; else compiled now, and exported for
    the next process where the cache can take it. Never raises for the cache's sake: a cache that cannot
    be used costs a compile and one warning."""
    try:
        root = default_cache_dir()
        path = cache_path(build, root)
    except CacheError as exc:
        warn_once(f"CuTe kernels are compiled in memory: {exc}")
        return _compile_in_memory(build)
    distrusted = untrusted(path.parent, root)
    if distrusted:
        warn_once(f"CuTe kernels are compiled in memory, neither loaded from nor kept in {path.parent}: {distrusted}")
        return _compile_in_memory(build)
    if path.exists():
        why = untrusted(path, root) or check_object(path)
        if why is None:
            try:
                return load(path, root)
            except Exception as exc:  # an object that passed its check but does not load: compile instead
                why = f"it does not load ({type(exc).__name__}: {exc})"
        warn_once(f"not loading the CuTe kernel {path}: {why}; it is compiled instead")
    if not can_compile_here(build.arch):
        try:
            return load(build_cached(build, root)[0], root)
        except CacheError as exc:
            warn_once(f"CuTe kernels are compiled in memory: {exc}")
            return _compile_in_memory(build)
    fn = compile_kernel(build)
    try:
        with locked(path.parent / "locks" / f"{path.stem}.lock"):
            if check_object(path) is not None:
                export(fn, path)
    except OSError as exc:  # CacheError included: a read-only cache costs the next process a compile
        warn_once(f"CuTe kernels compiled here are not kept for the next process: {exc}")
    return fn


def _compile_in_memory(build: CuteBuild):
    """The kernel compiled in this process, or, for another arch than this process's DSL targets, exported
    by a child into this process's scratch folder and loaded from there."""
    if can_compile_here(build.arch):
        return compile_kernel(build)
    return load(build_cached(build, scratch_dir())[0])


def forget() -> None:
    """Forget the kernels this process loaded (tests)."""
    _compiled.clear()

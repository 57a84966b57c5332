"""Compiling CuTe-DSL kernels (with no GPU if need be), exporting them to the build cache and loading them.

A ``CuteBuild`` names one kernel as data: the rendered module that defines it, the dtype and causality
it is compiled for, the target arch, the cache folder it belongs in, and a factory (``"module:function"``)
that, given the imported module, returns the kernel object and the fake arguments ``cute.compile`` traces
it with. Fake tensors have symbolic shapes and strides, so one compiled kernel serves every batch, head
count, sequence length and stride. Compiled kernels are exported (``export_to_c``) into
``<cache>/<cache_name>/<key>.o``, keyed by attnforge and CuTe-DSL versions, arch, variant and the module's
source, and later processes load them from there, so a machine compiles each variant once. Kernels are
called through TVM FFI (``--enable-tvm-ffi``): torch tensors go in directly, on the current stream.

The CuTe DSL fixes its target arch when ``cutlass`` is first imported (``CUTE_DSL_ARCH``; with no GPU its
own detection picks sm_100a, on which WGMMA kernels do not build; docs/kernel-notes.md section 8). A process set up for one arch builds
another arch's kernels in a child process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib
import json
import os
import pathlib
import subprocess
import sys
import threading

from .._version import __version__
from .cache import default_cache_dir, locked

EXPORTED_NAME = "attnforge_kernel"


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


def target(arch: str) -> None:
    """Before anything imports cutlass: make ``arch`` the arch it will compile for, unless CUTE_DSL_ARCH
    says otherwise already."""
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", arch)


def arch_ready(arch: str) -> bool:
    """Whether this process's CuTe DSL compiles for ``arch`` (decided when cutlass was imported)."""
    env = os.environ.get("CUTE_DSL_ARCH")
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
        raise RuntimeError(f"the CuTe DSL was imported here for {os.environ.get('CUTE_DSL_ARCH') or 'the local GPU'}; "
                           f"these kernels compile for {arch}: set CUTE_DSL_ARCH={arch} before anything imports cutlass")
    return cutlass


def _module(build: CuteBuild):
    target(build.arch)  # the module imports cutlass at its top
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

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".o")
    os.close(fd)
    try:
        fn.export_to_c(object_file_path=tmp, function_name=EXPORTED_NAME)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a deployment's cache is read by its users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_runtime_libraries() -> None:
    # A kernel loaded from an object file resolves the CuTe runtime's symbols through the global
    # namespace; cute.runtime.load_module does not load those libraries RTLD_GLOBAL itself.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if pathlib.Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def load(path: pathlib.Path):
    """The callable kernel exported to ``path``."""
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
    """Compile and export one kernel into the cache unless it is there (in a child process when this one's
    CuTe DSL targets another arch). ``keep_asm``: also keep its PTX, cubin and SASS in ``<key>.asm/``.
    Returns (path, built_now)."""
    path = cache_path(build, cache_dir)
    asm_dir = path.with_suffix(".asm")
    with locked(path.parent / "locks" / f"{path.stem}.lock"):
        have = path.is_file() and path.stat().st_size
        if have and (not keep_asm or asm_dir.is_dir()):
            return path, False
        if not have:
            if can_compile_here(build.arch):
                export(compile_kernel(build), path)
            else:
                _in_child(build, "export", str(path))
        if keep_asm:
            compile_to(build, str(asm_dir))
            _write_sass(asm_dir)
        return path, True


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
    path = cache_path(build)
    if path.is_file():
        try:
            return load(path)
        except Exception:  # torn or foreign entry: rebuild it
            path.unlink(missing_ok=True)
    if not can_compile_here(build.arch):
        return load(build_cached(build)[0])
    fn = compile_kernel(build)
    try:
        with locked(path.parent / "locks" / f"{path.stem}.lock"):
            if not path.is_file():
                export(fn, path)
    except OSError:
        pass  # a read-only cache only costs the next process a compile
    return fn


def forget() -> None:
    """Forget the kernels this process loaded (tests)."""
    _compiled.clear()

"""Compiling the generated CuTe-DSL kernels, with no GPU if need be, and caching them.

Each (variant module, dtype, causal) compiles once per process with `cute.compile` against fake
tensors whose shapes and strides are symbolic, so one compiled kernel serves every batch, head count,
sequence length and stride. Compiled kernels are exported to the attnforge cache directory
(`export_to_c`, keyed by attnforge version, CuTe-DSL version, target, variant and the generated
source) and loaded from there by later processes, so a machine compiles each variant once.
Kernels are called through TVM FFI (`--enable-tvm-ffi`): torch tensors go in directly, on the
current stream, with no per-call conversion.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import pathlib
import sys
import tempfile
import threading

from ..._version import __version__
from ...codegen.build import _locked, default_cache_dir

ARCH = "sm_90a"
EXPORTED_NAME = "attnforge_fwd"
DTYPES = ("fp16", "bf16", "fp8")
KIND = {"fp16": "16bit", "bf16": "16bit", "fp8": "fp8"}

def import_cutlass(arch: str = ARCH):
    """Import the CuTe DSL for ``arch`` (sm_90a here; cute_sm100 passes sm_100a). It reads CUTE_DSL_ARCH
    once, at import, and with no GPU its detection picks sm_100a, on which WGMMA kernels do not build
    (notes/cute-dsl-attention.md §5): so the variable is set first, and a mismatch is an error."""
    target(arch)
    import cutlass

    if not arch_ready(arch):
        raise RuntimeError(f"the CuTe DSL was imported here for {os.environ.get('CUTE_DSL_ARCH') or 'the local GPU'}; "
                           f"these kernels compile for {arch}: set CUTE_DSL_ARCH={arch} before anything imports cutlass")
    return cutlass


def target(arch: str) -> None:
    """Before anything imports cutlass (a generated kernel module does, at its top): make ``arch`` the
    arch it will compile for, unless CUTE_DSL_ARCH says otherwise already."""
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
    return arch == "sm_100a"  # the DSL's choice with no GPU


def elements(dtype: str, arch: str = ARCH):
    """(input, output) CuTe element types: FP8 (e4m3) in gives bf16 out."""
    cutlass = import_cutlass(arch)
    element = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN}[dtype]
    return element, (cutlass.BFloat16 if dtype == "fp8" else element)


def fake_arguments(dtype: str, head_dim: int, arch: str = ARCH, takes_max_ctas: bool = False,
                   tail_split: bool = False):
    """Fake arguments for cute.compile: q, k, v, out (batch, heads, seqlen, head_dim) with symbolic sizes
    and strides (16-byte aligned rows, as TMA needs), fp32 LSE (batch, heads, seqlen), then for FP8
    the descales (3, batch, heads_kv) in fp32, then scale_log2, with ``takes_max_ctas`` the Int32 CTA count a
    persistent kernel may launch (cute_sm90's take it; pass the SM count), with ``tail_split`` the pieces'
    fp32 workspaces (pieces, tile_m, head_dim) and (pieces, tile_m) and two Int32 counts (see tail_split.py),
    and the stream. FP8's v is V^T (batch, heads_kv, head_dim, seqlen_k padded to 32): see v_layout.py."""
    cutlass = import_cutlass(arch)
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    element, out_element = elements(dtype, arch)
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, seqlen_v = (cute.sym_int32() for _ in range(6))

    def tensor(elem, *shape):
        strides = [cute.sym_int64(divisibility=16 // (elem.width // 8)) for _ in range(3)]
        return make_fake_tensor(elem, shape, (*strides, 1), assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (batch, heads_q, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=4)
    q, k = tensor(element, batch, heads_q, seqlen_q, head_dim), tensor(element, batch, heads_kv, seqlen_k, head_dim)
    out = tensor(out_element, batch, heads_q, seqlen_q, head_dim)
    max_ctas = (cutlass.Int32(1),) if takes_max_ctas else ()
    split = ()
    if tail_split:
        pieces, rows = cute.sym_int32(), cute.sym_int32()
        split = (make_fake_tensor(cutlass.Float32, (pieces, rows, head_dim), (cute.sym_int64(divisibility=4), head_dim, 1),
                                  assumed_align=16),
                 make_fake_tensor(cutlass.Float32, (pieces, rows), (cute.sym_int64(), 1), assumed_align=4),
                 cutlass.Int32(1), cutlass.Int32(1))
    tail = (cutlass.Float32(1.0), *max_ctas, *split, make_fake_stream(use_tvm_ffi_env_stream=True))
    if dtype != "fp8":
        return (q, k, tensor(element, batch, heads_kv, seqlen_k, head_dim), out, lse, *tail)
    v_t = tensor(element, batch, heads_kv, head_dim, seqlen_v)
    descale = make_fake_tensor(cutlass.Float32, (3, batch, heads_kv), (cute.sym_int64(), cute.sym_int64(), 1),
                               assumed_align=4)
    return (q, k, v_t, out, lse, descale, *tail)


def _load_runtime_libraries() -> None:
    # A kernel loaded from an object file resolves the CuTe runtime's symbols through the global
    # namespace; cute.runtime.load_module does not load those libraries RTLD_GLOBAL itself.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if pathlib.Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def export(fn, path: pathlib.Path) -> None:
    """Write a compiled kernel to ``path`` (atomically: a reader sees no file or a whole one)."""
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


def load(path: pathlib.Path):
    import cutlass.cute as cute

    _load_runtime_libraries()
    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), EXPORTED_NAME)


class Target:
    """The compile-and-cache machinery for one CuTe-DSL backend: its arch, its generated kernel package
    and its cache folder. cute_sm90 and cute_sm100 each have one (``TARGET``)."""

    def __init__(self, arch: str, package: str, cache_name: str):
        self.arch, self.package, self.cache_name = arch, package, cache_name
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def kernel_module(self, module: str):
        target(self.arch)
        return importlib.import_module(f"{self.package}._generated.{module}")

    def can_compile_here(self) -> bool:
        """Whether this process's CuTe DSL compiles for this arch (or can still be set up for it)."""
        if "cutlass" in sys.modules:
            return arch_ready(self.arch)
        return os.environ.get("CUTE_DSL_ARCH") in (None, "", self.arch)

    def compile_kernel(self, module: str, dtype: str, causal: bool, dump_dir: str | None = None):
        """cute.compile one generated variant in this process (works with no GPU). ``dump_dir``: keep PTX and cubin."""
        import_cutlass(self.arch)
        return self.compile_module(self.kernel_module(module), dtype, causal, dump_dir)

    def compile_module(self, mod, dtype: str, causal: bool, dump_dir: str | None = None):
        """cute.compile the kernel of a rendered module object (the generated ones, or a tile sweep's)."""
        import_cutlass(self.arch)
        import cutlass.cute as cute

        element, out_element = elements(dtype, self.arch)
        options = f"--enable-tvm-ffi --gpu-arch {self.arch}"
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)  # the DSL writes nothing, silently, into a missing directory
            options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
        args = fake_arguments(dtype, mod.HEAD_DIM, self.arch, takes_max_ctas=getattr(mod, "MAX_CTAS_ARGUMENT", False),
                              tail_split=getattr(mod, "TAIL_SPLIT", False))
        return cute.compile(mod.Forward(element, out_element, causal), *args, options=options)

    def _in_child(self, call: str) -> None:
        """Run ``t.<call>`` in a fresh process whose CuTe DSL targets this arch (it fixes its target at import)."""
        import subprocess

        code = f"from {self.package}.compile import TARGET as t; import pathlib; t.{call}"
        done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CUTE_DSL_ARCH=self.arch),
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"CuTe DSL compile for {self.arch} failed:\n{done.stderr[-4000:]}")

    def compile_in_child(self, module: str, dtype: str, causal: bool, dump_dir: str) -> None:
        self._in_child(f"compile_kernel({module!r}, {dtype!r}, {causal!r}, dump_dir={dump_dir!r})")

    def compile_to(self, module: str, dtype: str, causal: bool, dump_dir: str) -> None:
        """Compile one variant keeping its PTX and cubin in ``dump_dir``, in this process if it can, else a child."""
        if self.can_compile_here():
            self.compile_kernel(module, dtype, causal, dump_dir=dump_dir)
        else:
            self.compile_in_child(module, dtype, causal, dump_dir)

    def cache_path(self, module: str, dtype: str, causal: bool, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
        """<cache>/<backend>/<key>.o, the key from attnforge and CuTe-DSL versions, arch, variant and source."""
        from importlib.metadata import version

        source = pathlib.Path(self.kernel_module(module).__file__).read_bytes()
        h = hashlib.sha256()
        for part in (__version__, version("nvidia-cutlass-dsl"), self.arch, module, dtype, str(causal)):
            h.update(part.encode() + b"\0")
        h.update(source)
        return pathlib.Path(cache_dir or default_cache_dir()) / self.cache_name / f"{h.hexdigest()[:32]}.o"

    def build_cached(self, module: str, dtype: str, causal: bool,
                     cache_dir: pathlib.Path | None = None) -> tuple[pathlib.Path, bool]:
        """Compile and export one variant into the cache unless it is there (in a child process when this
        one's CuTe DSL targets another arch). Returns (path, built_now)."""
        path = self.cache_path(module, dtype, causal, cache_dir)
        with _locked(path.parent / "locks" / f"{path.stem}.lock"):
            if path.is_file() and path.stat().st_size:
                return path, False
            if self.can_compile_here():
                export(self.compile_kernel(module, dtype, causal), path)
            else:
                self._in_child(f"build_export({module!r}, {dtype!r}, {causal!r}, pathlib.Path({str(path)!r}))")
            return path, True

    def build_export(self, module: str, dtype: str, causal: bool, path: pathlib.Path) -> None:
        export(self.compile_kernel(module, dtype, causal), path)

    def compiled(self, module: str, dtype: str, causal: bool):
        """The callable kernel for a variant: from this process's memory, else from the disk cache, else
        compiled now (and exported for the next process). Thread-safe."""
        key = (module, dtype, causal)
        fn = self._compiled.get(key)
        if fn is not None:
            return fn
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = self._load_or_compile(module, dtype, causal)
            return self._compiled[key]

    def _load_or_compile(self, module: str, dtype: str, causal: bool):
        path = self.cache_path(module, dtype, causal)
        if path.is_file():
            try:
                return load(path)
            except Exception:  # torn or foreign entry: rebuild it
                path.unlink(missing_ok=True)
        if not self.can_compile_here():
            return load(self.build_cached(module, dtype, causal)[0])
        fn = self.compile_kernel(module, dtype, causal)
        try:
            with _locked(path.parent / "locks" / f"{path.stem}.lock"):
                if not path.is_file():
                    export(fn, path)
        except OSError:
            pass  # a read-only cache only costs the next process a compile
        return fn

    def forget(self) -> None:
        self._compiled.clear()


TARGET = Target(ARCH, __package__, "cute_sm90")
kernel_module, compile_kernel, compile_module = TARGET.kernel_module, TARGET.compile_kernel, TARGET.compile_module
compile_to, cache_path, build_cached, compiled = TARGET.compile_to, TARGET.cache_path, TARGET.build_cached, TARGET.compiled

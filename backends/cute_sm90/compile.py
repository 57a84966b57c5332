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
GENERATED = f"{__package__}._generated"
EXPORTED_NAME = "attnforge_fwd"
DTYPES = ("fp16", "bf16", "fp8")
KIND = {"fp16": "16bit", "bf16": "16bit", "fp8": "fp8"}

_compiled: dict[tuple, object] = {}
_lock = threading.Lock()


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


def kernel_module(module: str):
    target(ARCH)
    return importlib.import_module(f"{GENERATED}.{module}")


def elements(dtype: str, arch: str = ARCH):
    """(input, output) CuTe element types: FP8 (e4m3) in gives bf16 out."""
    cutlass = import_cutlass(arch)
    element = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN}[dtype]
    return element, (cutlass.BFloat16 if dtype == "fp8" else element)


def fake_arguments(dtype: str, head_dim: int, arch: str = ARCH):
    """Fake arguments for cute.compile: q, k, v, out (batch, heads, seqlen, head_dim) with symbolic sizes
    and strides (16-byte aligned rows, as TMA needs), fp32 LSE (batch, heads, seqlen), then for FP8
    the descales (3, batch, heads_kv) in fp32, then scale_log2 and the stream. FP8's v is V^T
    (batch, heads_kv, head_dim, seqlen_k padded to 32): see prepare_v_fp8."""
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
    tail = (cutlass.Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))
    if dtype != "fp8":
        return (q, k, tensor(element, batch, heads_kv, seqlen_k, head_dim), out, lse, *tail)
    v_t = tensor(element, batch, heads_kv, head_dim, seqlen_v)
    descale = make_fake_tensor(cutlass.Float32, (3, batch, heads_kv), (cute.sym_int64(), cute.sym_int64(), 1),
                               assumed_align=4)
    return (q, k, v_t, out, lse, descale, *tail)


# FP8: the key order within every 32-key block of V^T that fp8_p_operand (in the template) expects:
# slot k = 16*h + 4*c + 2*a + b (h, a, b in {0, 1}, c in 0..3) holds key 16*h + 8*a + 2*c + b.
FP8_KEY_ORDER = tuple(16 * (k // 16) + 8 * ((k % 4) // 2) + 2 * ((k % 16) // 4) + k % 2 for k in range(32))


def prepare_v_fp8(v):
    """V (batch, heads_kv, seqlen_k, head_dim) e4m3 -> V^T (batch, heads_kv, head_dim, seqlen_k padded to
    32) with keys in FP8_KEY_ORDER: FP8 WGMMA wants both operands K-major (keys contiguous for P @ V).
    One strided copy of V (its cost is measured in benchmarks/results/)."""
    import torch

    b, h, n, d = v.shape
    padded = -(-n // 32) * 32
    raw = v.view(torch.uint8)  # copy and pad kernels are not all built for float8 dtypes
    if padded != n:  # zero keys: masked in S, and 0 * V adds nothing
        raw = torch.nn.functional.pad(raw, (0, 0, 0, padded - n))
    # keys as (block, h, a, c, b) -> slots as (block, h, c, a, b), with head_dim moved in front
    keys = raw.reshape(b, h, padded // 32, 2, 2, 4, 2, d)
    return keys.permute(0, 1, 7, 2, 3, 5, 4, 6).reshape(b, h, d, padded).view(v.dtype)


def compile_kernel(module: str, dtype: str, causal: bool, dump_dir: str | None = None):
    """cute.compile one generated variant for sm_90a (works with no GPU). ``dump_dir``: keep PTX and cubin there."""
    return compile_module(kernel_module(module), dtype, causal, dump_dir)


def compile_module(mod, dtype: str, causal: bool, dump_dir: str | None = None):
    """cute.compile the kernel of a rendered module object (the generated ones, or a tile sweep's)."""
    import_cutlass()
    import cutlass.cute as cute

    element, out_element = elements(dtype)
    options = f"--enable-tvm-ffi --gpu-arch {ARCH}"
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)  # the DSL writes nothing, silently, into a missing directory
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return cute.compile(mod.Forward(element, out_element, causal), *fake_arguments(dtype, mod.HEAD_DIM), options=options)


def compile_to(module: str, dtype: str, causal: bool, dump_dir: str) -> None:
    """Compile one variant keeping its PTX and cubin in ``dump_dir``: in this process when its CuTe DSL
    targets sm_90a, else in a child process set up for it (the DSL fixes its target at import)."""
    if "cutlass" not in sys.modules or arch_ready(ARCH):
        compile_kernel(module, dtype, causal, dump_dir=dump_dir)
    else:
        _child(f"from attnforge.backends.cute_sm90 import compile as c; "
               f"c.compile_kernel({module!r}, {dtype!r}, {causal!r}, dump_dir={dump_dir!r})")


def _child(code: str, arch: str = ARCH) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CUTE_DSL_ARCH=arch),
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"CuTe DSL compile for {arch} failed:\n{done.stderr[-4000:]}")


def cache_key(module: str, dtype: str, causal: bool) -> str:
    from importlib.metadata import version

    source = pathlib.Path(kernel_module(module).__file__).read_bytes()
    h = hashlib.sha256()
    for part in (__version__, version("nvidia-cutlass-dsl"), ARCH, module, dtype, str(causal)):
        h.update(part.encode() + b"\0")
    h.update(source)
    return h.hexdigest()[:32]


def cache_path(module: str, dtype: str, causal: bool, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    return pathlib.Path(cache_dir or default_cache_dir()) / "cute_sm90" / f"{cache_key(module, dtype, causal)}.o"


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


def build_cached(module: str, dtype: str, causal: bool, cache_dir: pathlib.Path | None = None) -> tuple[pathlib.Path, bool]:
    """Compile and export one variant into the cache unless it is there (in a child process when this
    one's CuTe DSL targets another arch). Returns (path, built_now)."""
    path = cache_path(module, dtype, causal, cache_dir)
    with _locked(path.parent / "locks" / f"{path.stem}.lock"):
        if path.is_file() and path.stat().st_size:
            return path, False
        if "cutlass" not in sys.modules or arch_ready(ARCH):
            export(compile_kernel(module, dtype, causal), path)
        else:
            _child(f"from attnforge.backends.cute_sm90 import compile as c; import pathlib; "
                   f"c.export(c.compile_kernel({module!r}, {dtype!r}, {causal!r}), pathlib.Path({str(path)!r}))")
        return path, True


def compiled(module: str, dtype: str, causal: bool):
    """The callable kernel for a variant: from this process's memory, else from the disk cache, else
    compiled now (and exported for the next process). Thread-safe."""
    key = (module, dtype, causal)
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _lock:
        if key not in _compiled:
            import_cutlass()
            path = cache_path(module, dtype, causal)
            fn = None
            if path.is_file():
                try:
                    fn = load(path)
                except Exception:  # torn or foreign entry: rebuild it
                    path.unlink(missing_ok=True)
            if fn is None:
                fn = compile_kernel(module, dtype, causal)
                try:
                    with _locked(path.parent / "locks" / f"{path.stem}.lock"):
                        if not path.is_file():
                            export(fn, path)
                except OSError:
                    pass  # a read-only cache only costs the next process a compile
            _compiled[key] = fn
        return _compiled[key]


def forget() -> None:
    _compiled.clear()

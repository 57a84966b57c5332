"""Ahead-of-time compilation of Triton kernels (no GPU needed) into the build cache, and loading them back.

``triton.compile`` with a GPUTarget compiles a kernel for any NVIDIA (or AMD) target on a machine with
no GPU. A ``KernelBuild`` says everything the compile needs as data: the file that defines the kernel,
its name, target, signature and constants. The cache entry is keyed by attnforge's version, the
kernel file's source, the Triton version, the target and the variant; each key is built under a file
lock, published by rename, and an entry whose binary does not match the digest recorded beside it is
deleted and rebuilt.

Triton's own cache is not shipped: its key hashes libtriton and absolute paths, so an entry made on
one machine is not found on another. An entry here holds the binary and Triton's metadata JSON, from
which ``triton.compiler.CompiledKernel`` launches with no compilation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from .._version import __version__
from .cache import DIR_MODE, FILE_MODE, CacheError, locked, untrusted, warn_once
from .env import triton_flag

# Instructions that show a kernel uses what its target offers: HMMA (sm80/89 mma.sync), HGMMA/QGMMA
# (sm90 WGMMA, 16- and 8-bit), UTMALDG (sm90 TMA loads), LDGSTS (cp.async), UTCHMMA (sm100 tcgen05),
# v_mfma (CDNA matrix cores). See docs/kernel-notes.md.
MARKERS = r"\b(HMMA\.\w+|HGMMA\.\w+|UTMALDG\.\w+|LDGSTS|UTCHMMA\w*|QGMMA\.\w+|v_mfma\w+)"


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One @triton.jit kernel of one Python file, specialised for a target, dtype, head dim and causality.

    ``signature``: (parameter, Triton type) for every parameter, constexprs as "constexpr";
    ``constexprs``: (name, value) of the constexpr parameters; ``aligned``: the parameters compiled as
    divisible by 16, as Triton's JIT specialises them: pointers 16-byte aligned, integers (a row stride,
    say) multiples of 16 (launch() takes the prebuilt kernel only for a call whose arguments are);
    ``options``: further compile options ((name, value) pairs: AMD's waves_per_eu, ...). ``head_dim`` 0
    names a kernel that serves every head dim."""

    path: str
    module: str  # the name the build is listed under (the variant's module name)
    kernel: str
    arch: str  # "sm80", "sm90", "gfx942", ...
    dtype: str
    head_dim: int
    causal: bool
    num_warps: int
    num_stages: int
    signature: tuple = ()
    constexprs: tuple = ()
    aligned: tuple = ()
    options: tuple = ()

    @property
    def amd(self) -> bool:
        return self.arch.startswith("gfx")

    def target(self):
        from triton.backends.compiler import GPUTarget

        if self.amd:
            return GPUTarget("hip", self.arch, 64)
        return GPUTarget("cuda", int(self.arch.removeprefix("sm")), 32)

    def name(self) -> str:
        """module.kernel.arch.dtype.d<head dim>.causal|full, then the feature flags it is built with (.local, ...) and
        its other integer constants (.splits8)."""
        flags = "".join(f".{name.lower()}" if on is True else f".{name.lower()}{on}" for name, on in self.constexprs
                        if (on is True and name != "CAUSAL") or (type(on) is int and name not in ("HEAD_DIM", "D")))
        return (f"{self.module}.{self.kernel}.{self.arch}.{self.dtype}.d{self.head_dim or 'any'}."
                f"{'causal' if self.causal else 'full'}{flags}")


@dataclasses.dataclass(frozen=True)
class Prebuilt:
    """A prebuilt kernel loaded from the cache: Triton's CompiledKernel, and the positions (among the arguments
    a launch passes, constexprs excluded) of the integer parameters it was compiled as multiples of 16 for."""

    kernel: object
    multiples_of_16: tuple[int, ...] = ()
    # positions of the integer parameters it was compiled as the constant 1 for (AT_ONE)
    ones: tuple[int, ...] = ()

    @property
    def metadata(self):
        return self.kernel.metadata

    def accepts(self, args) -> bool:
        """Whether the call's ``args`` meet what the kernel was compiled assuming: tensors 16-byte aligned,
        integers within int32, and the multiples_of_16 integers multiples of 16 (any other call goes to the
        JIT, which specialises for it)."""
        for a in args:
            if isinstance(a, int):
                if not -_INT32 <= a <= _INT32:
                    return False
            elif getattr(a, "data_ptr", None) is not None and a.data_ptr() % 16:
                return False
        return all(args[i] % 16 == 0 for i in self.multiples_of_16) and all(args[i] == 1 for i in self.ones)


# Integer parameters a build may compile as the constant 1, as Triton's JIT compiles an integer argument equal to 1:
# GROUP (query heads per KV head) is 1 in every call without grouped-query attention, and the JIT then drops the
# kernels' loop over the group (triton_fa2's causal dK/dV kernel at d=128 on sm90: 2488 instructions against 2776). The
# launch still passes the argument in its place (the kernel's signature is unchanged: only the build's is).
AT_ONE = ("GROUP",)
# Sizes a GROUP = 1 build also compiles as multiples of 16, as the JIT compiles a call whose sequence lengths are
# (the common training call): triton_fa2's sm90 d=128 causal dK/dV kernel then spills 64 bytes instead of 120 and has
# 2392 instructions instead of 2488 (Triton 3.9): the likely cause of its running 19% slower prebuilt than JIT
# (1468.5 against 1236.9 us, H100, 4 x 4096 x 16 heads; docs/performance.md; not re-timed since). A call with other
# lengths runs the generic build (triton_launch.launch), which compiles nothing at run time either.
COMMON_MULTIPLES_OF_16 = ("N_Q", "N_K")


def launch_parameters(signature) -> list[tuple[str, str]]:
    """The (name, type) pairs of ``signature`` a launch passes before the constexprs: every non-constexpr
    parameter, and the AT_ONE ones a build compiled as constants."""
    return [(name, kind) for name, kind in signature if kind != "constexpr" or name in AT_ONE]


def multiples_of_16(signature, aligned) -> tuple[int, ...]:
    """Positions, among the parameters a launch passes (launch_parameters), of the integer ones in ``aligned``."""
    return tuple(i for i, (name, kind) in enumerate(launch_parameters(signature))
                 if name in aligned and kind.startswith(("i", "u")))


def ones(signature) -> tuple[int, ...]:
    """Positions, among the parameters a launch passes, of the AT_ONE ones ``signature`` compiles as constants."""
    return tuple(i for i, (name, kind) in enumerate(launch_parameters(signature)) if kind == "constexpr")


_INT32 = 2**31 - 1
_file_modules: dict[str, object] = {}


def kernel_function(path: str, kernel: str):
    """The @triton.jit function ``kernel`` of the Python file ``path`` (imported once per process; a
    file inside an imported package is found under its own module name)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path and hasattr(module, kernel):
            return getattr(module, kernel)
    if path not in _file_modules:
        from .generated import import_path

        _file_modules[path] = import_path(path)
    return getattr(_file_modules[path], kernel)


def source_of(build: KernelBuild, signature=None, constexprs=None, aligned=None):
    """Triton's ASTSource for the kernel, specialised as the build says (or as the given fields)."""
    from triton.compiler import ASTSource

    sig = dict(build.signature if signature is None else signature)
    aligned = build.aligned if aligned is None else aligned
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in aligned}
    return ASTSource(fn=kernel_function(build.path, build.kernel), signature=sig,
                     constexprs=dict(build.constexprs if constexprs is None else constexprs), attrs=attrs)


def fp_fusion() -> bool:
    """Whether kernels are compiled with FMA fusion: TRITON_DEFAULT_FP_FUSION as Triton reads it (default
    on). Passed to triton.compile as an option, so no call sets the variable in the user's environment."""
    return triton_flag("TRITON_DEFAULT_FP_FUSION", True)


def compile_kernel(build: KernelBuild):
    """triton.compile the kernel for its target; returns the CompiledKernel."""
    import triton

    options = {"num_warps": build.num_warps, "num_stages": build.num_stages, "enable_fp_fusion": fp_fusion(),
               **dict(build.options)}
    return triton.compile(source_of(build), target=build.target(), options=options)


# How builds specialise their arguments, in the cache key: "2" since integer parameters (row strides) are compiled as
# multiples of 16 where the JIT would be; entries built before, with only the pointers aligned, are not reused. "3"
# since GROUP = 1 builds take the sequence lengths as multiples of 16 too (COMMON_MULTIPLES_OF_16).
SPECIALISATION = "3"


def fingerprint(build: KernelBuild) -> str:
    """The cache key: attnforge version, the kernel file's source, Triton version, target and variant, with every
    constexpr (two builds of one kernel that differ only in a feature flag, LOCAL say, are two entries)."""
    import triton

    h = hashlib.sha256()
    for part in (__version__, SPECIALISATION, triton.__version__, "1" if fp_fusion() else "0", build.name(),
                 str(build.num_warps), str(build.num_stages), repr(build.options), repr(sorted(build.constexprs))):
        h.update(part.encode() + b"\0")
    h.update(pathlib.Path(build.path).read_bytes())
    return h.hexdigest()[:32]


def _nvidia_tool(name: str) -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cuobjdump(*args: str) -> str:
    """The output of the cuobjdump that Triton ships (SASS listings, resource usage), no GPU needed."""
    return subprocess.run([_nvidia_tool("cuobjdump"), *args], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> str:
    """The SASS listing of a cubin (cuobjdump -sass)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return cuobjdump("-sass", f.name)


def resources(cubin: bytes) -> dict:
    """Registers, stack (spill) bytes and local memory of a cubin, from cuobjdump -res-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = cuobjdump("-res-usage", f.name)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(fields.get("REG", 0)), "stack_bytes": int(fields.get("STACK", 0)),
            "local_bytes": int(fields.get("LOCAL", 0))}


def amd_resources(amdgcn: str) -> dict:
    """VGPRs, scratch (spill) bytes and spilled VGPRs from a kernel's AMDGCN listing."""
    def first(pattern):
        found = re.findall(pattern, amdgcn)
        return int(found[0]) if found else 0
    return {"registers": first(r"\.vgpr_count:\s*(\d+)"), "stack_bytes": first(r"; ScratchSize: (\d+)"),
            "local_bytes": 0, "vgpr_spills": first(r"\.vgpr_spill_count:\s*(\d+)")}


def instructions(asm: str) -> list[str]:
    """The matrix-core and TMA instructions a kernel's SASS or AMDGCN uses."""
    return sorted(set(re.findall(MARKERS, asm)))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BadEntry(Exception):
    """A cache entry that is not whole and valid; the message says what is wrong."""


def _field(meta: dict, name: str, kind, check=lambda value: True):
    value = meta.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not check(value):
        raise BadEntry(f"meta.json field {name!r} is {value!r}")
    return value


def _pairs(value) -> bool:
    return all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value)


def _check_meta(meta) -> dict:
    """The fields load_cached and run() read, each of the type they need."""
    if not isinstance(meta, dict):
        raise BadEntry(f"meta.json holds a {type(meta).__name__}, not an object")
    _field(meta, "kernel_name", str, str.isidentifier)
    _field(meta, "binary", str, lambda b: b in ("kernel.cubin", "kernel.hsaco"))
    _field(meta, "binary_bytes", int, lambda n: n > 0)
    _field(meta, "binary_sha256", str, lambda h: len(h) == 64)
    _field(meta, "key", str)
    _field(meta, "signature", list, _pairs)
    _field(meta, "constexprs", list, _pairs)
    _field(meta, "aligned", list, lambda a: all(isinstance(x, str) for x in a))
    for name in ("registers", "stack_bytes", "shared_bytes"):
        _field(meta, name, int, lambda n: n >= 0)
    _field(meta, "asm", list, lambda a: all(isinstance(x, str) for x in a))
    if meta.get("instructions") is not None:
        _field(meta, "instructions", list, lambda a: all(isinstance(x, str) for x in a))
    return meta


def _check_triton_json(entry: pathlib.Path, kernel_name: str) -> None:
    data = json.loads((entry / "triton.json").read_text())
    if not isinstance(data, dict) or data.get("name") != kernel_name:
        raise BadEntry(f"triton.json is not Triton's metadata of {kernel_name}")


def _read_entry(entry: pathlib.Path, key: str | None = None) -> dict:
    """The entry's metadata, checked: every field read has its type, Triton's metadata names the kernel,
    and the binary matches the recorded size and digest. Raises BadEntry (or OSError: no entry)."""
    try:
        meta = _check_meta(json.loads((entry / "meta.json").read_text()))
        if key is not None and meta["key"] != key:
            raise BadEntry(f"meta.json is of entry {meta['key']}, not {key}")
        _check_triton_json(entry, meta["kernel_name"])
        binary = (entry / meta["binary"]).read_bytes()
    except ValueError as exc:  # JSON that does not parse
        raise BadEntry(f"unreadable JSON ({exc})") from exc
    if len(binary) != meta["binary_bytes"] or _sha256(binary) != meta["binary_sha256"]:
        raise BadEntry(f"{meta['binary']} does not match the size and sha256 recorded in meta.json")
    return meta


def entry_path(build: KernelBuild, cache_dir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(cache_dir) / fingerprint(build)


def _whole(entry: pathlib.Path, key: str) -> dict | None:
    """The entry's metadata, or None when there is no entry or a bad one (said in a warning)."""
    if not (entry / "meta.json").exists():
        return None
    try:
        return _read_entry(entry, key)
    except FileNotFoundError:
        return None
    except (BadEntry, OSError) as exc:
        warn_once(f"ignoring the Triton build entry {entry}: {exc}")
        return None


def load_cached(build: KernelBuild, cache_dir: pathlib.Path) -> Prebuilt | None:
    """The Prebuilt kernel for ``build`` from the cache, ready to launch with no compilation, or None when
    the cache has no whole, valid and trusted entry for it (cache.untrusted), or one compiled with other
    constants. Bad and untrusted entries are passed over with a warning: the JIT serves the call."""
    cache_dir = pathlib.Path(cache_dir)
    key = fingerprint(build)
    entry = cache_dir / key
    meta = _whole(entry, key)
    if meta is None:
        return None
    files = [entry / "meta.json", entry / "triton.json", entry / meta["binary"]]
    why = next(filter(None, (untrusted(f, cache_dir) for f in files)), None)
    if why:
        warn_once(f"not loading the prebuilt Triton kernel {entry}: {why}; the kernel is compiled instead")
        return None
    if build.constexprs and dict(build.constexprs) != {name: value for name, value in meta["constexprs"]}:
        return None
    from triton.compiler.compiler import CompiledKernel

    name, binary = meta["kernel_name"], meta["binary"]
    signature, aligned = [tuple(s) for s in meta["signature"]], tuple(meta["aligned"])
    src = source_of(build, signature=signature, constexprs=[tuple(c) for c in meta["constexprs"]], aligned=aligned)
    kernel = CompiledKernel(src, {f"{name}.json": str(entry / "triton.json"),
                                  f"{name}{pathlib.Path(binary).suffix}": str(entry / binary)}, meta["key"])
    return Prebuilt(kernel, multiples_of_16(signature, aligned), ones(signature))


def build_cached(build: KernelBuild, cache_dir: pathlib.Path, keep_asm: bool = False) -> tuple[dict, bool]:
    """Compile ``build`` into ``cache_dir`` unless a whole entry is there. Returns (meta, built_now).
    An entry that is there is found with no write (a read-only cache of built kernels is fine); a bad
    one is rebuilt, with a warning. Raises CacheError naming the path when the cache cannot be written."""
    cache_dir = pathlib.Path(cache_dir)
    key = fingerprint(build)
    entry = cache_dir / key
    meta = _whole(entry, key)
    if meta is not None and (not keep_asm or meta["asm"]):
        return meta, False
    with locked(cache_dir / "locks" / f"{key}.lock"):
        meta = _whole(entry, key)
        if meta is not None and (not keep_asm or meta["asm"]):
            return meta, False
        if entry.exists():  # corrupt, partial or without the listings asked for: rebuild from scratch
            try:
                shutil.rmtree(entry)
            except OSError as exc:
                raise CacheError(f"cannot remove the bad entry {entry}: {exc.strerror or exc}") from exc
        return _compile_into(build, cache_dir, key, keep_asm), True


def _compile_into(build: KernelBuild, cache_dir: pathlib.Path, key: str, keep_asm: bool) -> dict:
    ck = compile_kernel(build)
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
    except OSError as exc:
        raise CacheError(f"cannot write in {cache_dir}: {exc.strerror or exc}") from exc
    try:
        meta = _write_entry(build, ck, tmp, key, keep_asm)
        os.chmod(tmp, DIR_MODE)  # mkdtemp makes it private
        tmp.rename(cache_dir / key)  # atomic: a reader sees no entry or a whole one
        return meta
    except OSError as exc:
        raise CacheError(f"cannot write the entry {cache_dir / key}: {exc.strerror or exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_entry(build: KernelBuild, ck, tmp: pathlib.Path, key: str, keep_asm: bool) -> dict:
    binary_kind = "hsaco" if build.amd else "cubin"
    binary = ck.asm[binary_kind]
    files = {f"kernel.{binary_kind}": binary}
    if build.amd:  # the AMDGCN listing is small and holds the resource counts: always kept
        asm = {"kernel.amdgcn": ck.asm["amdgcn"]}
        res = amd_resources(asm["kernel.amdgcn"])
    else:
        res = resources(binary)
        asm = {"kernel.ptx": ck.asm["ptx"], "kernel.sass": ck.asm["sass"]} if keep_asm else {}
    files.update((name, text.encode()) for name, text in asm.items())
    listing = next(iter(asm.values()), None) if build.amd else asm.get("kernel.sass")
    # Triton's own metadata, from which triton.compiler.CompiledKernel loads the binary at run time.
    triton_json = next(p for name, p in ck.metadata_group.items() if name.endswith(".json"))
    files["triton.json"] = pathlib.Path(triton_json).read_bytes()
    meta = {"build": {k: v for k, v in dataclasses.asdict(build).items() if k != "path"}, "key": key,
            "kernel_name": ck.metadata.name, "shared_bytes": ck.metadata.shared,
            "binary": f"kernel.{binary_kind}", "binary_bytes": len(binary), "binary_sha256": _sha256(binary),
            "signature": [list(s) for s in build.signature], "constexprs": [list(c) for c in build.constexprs],
            "aligned": list(build.aligned), **res, "asm": sorted(asm),
            "instructions": instructions(listing) if listing else None}
    meta = json.loads(json.dumps(meta))  # as a later read will see it (tuples become lists)
    files["meta.json"] = json.dumps(meta, indent=1).encode()
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        os.chmod(tmp / name, FILE_MODE)
    return meta


def run(builds: list[KernelBuild], cache_dir: pathlib.Path, keep_asm: bool = False, progress=print) -> list[dict]:
    """Build (or find in the cache) every kernel of ``builds``, reporting each as it goes."""
    import time

    results = []
    for i, b in enumerate(builds, 1):
        t0 = time.perf_counter()
        meta, built = build_cached(b, cache_dir, keep_asm)
        what = f"built in {time.perf_counter() - t0:.1f}s" if built else "cached"
        spill = f", SPILLS {meta['stack_bytes']} B" if meta["stack_bytes"] else ""
        insns = f", {' '.join(meta['instructions'])}" if meta.get("instructions") else ""
        progress(f"[{i}/{len(builds)}] {b.name()}: {what} ({meta['registers']} {'VGPRs' if b.amd else 'registers'}, "
                 f"{meta['shared_bytes'] // 1024} KiB shared{spill}{insns})")
        results.append(meta)
    return results

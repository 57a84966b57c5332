"""Ahead-of-time compilation of the generated Triton kernels (no GPU needed) and the build cache.

``triton.compile`` with a GPUTarget compiles a generated kernel for any NVIDIA (or AMD) target on
a machine with no GPU. The cache is keyed by attnforge's version, a fingerprint of the generated
source, the toolchain (triton) version, the target and the variant; each key is built under a
file lock, and an entry that does not read back whole is deleted and rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

from .._version import __version__

# Pointer arguments that hold fp32 whatever the inputs' dtype; every other pointer holds the data dtype.
FP32_POINTERS = {"LSE", "DELTA"}
TRITON_DTYPES = {"fp16": "fp16", "bf16": "bf16"}
# Instructions that show a kernel uses what its target offers (../shared/notes/triton-attention.md, section 5).
MARKERS = r"\b(HMMA\.\w+|HGMMA\.\w+|UTMALDG\.\w+|LDGSTS|UTCHMMA\w*|QGMMA\.\w+|v_mfma\w+)"
FA2_PACKAGE = "attnforge.backends.triton_fa2._generated"
ROCM_PACKAGE = "attnforge.backends.triton_rocm._generated"


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One kernel of one generated module, specialised for a target, dtype, head dim and causality."""

    module: str  # module name under attnforge.backends.triton_fa2._generated
    kernel: str  # function name in it
    arch: str  # "sm80", "sm90", ...
    dtype: str
    head_dim: int  # 0: a kernel that serves every head dim (cute_sm90's FP8 V^T)
    causal: bool
    num_warps: int
    num_stages: int
    package: str = FA2_PACKAGE  # where the generated module lives
    options: tuple = ()  # further compile options, (name, value) pairs (AMD: waves_per_eu, ...)

    @property
    def amd(self) -> bool:
        return self.arch.startswith("gfx")

    def target(self):
        from triton.backends.compiler import GPUTarget

        if self.amd:
            return GPUTarget("hip", self.arch, 64)
        return GPUTarget("cuda", int(self.arch.removeprefix("sm")), 32)

    def name(self) -> str:
        return (f"{self.module}.{self.kernel}.{self.arch}.{self.dtype}.d{self.head_dim or 'any'}."
                f"{'causal' if self.causal else 'full'}")


def _function(build: KernelBuild):
    module = importlib.import_module(f"{build.package}.{build.module}")
    return module, getattr(module, build.kernel)


def signature(fn, dtype: str) -> tuple[dict, dict]:
    """Triton's signature and pointer-alignment attributes for a generated kernel, as the JIT would
    see them for 16-byte-aligned tensors (every pointer divisible by 16)."""
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.isupper() and p.name not in ("B", "H", "GROUP", "N_Q", "N_K"):
            sig[p.name] = "*fp32" if p.name in FP32_POINTERS else f"*{TRITON_DTYPES[dtype]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif "scale" in p.name:
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
    return sig, attrs


def _source(build: KernelBuild):
    """Triton's ASTSource for the kernel, specialised as the generated launcher calls it."""
    from triton.compiler import ASTSource

    module, fn = _function(build)
    if hasattr(module, "AOT_SIGNATURE"):  # a hand-written kernel that declares its own (cute_sm90's V^T)
        sig = dict(module.AOT_SIGNATURE)
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in module.AOT_ALIGNED}
        return ASTSource(fn=fn, signature=sig, constexprs=dict(module.AOT_CONSTEXPRS), attrs=attrs)
    sig, attrs = signature(fn, build.dtype)
    constexprs = {"HEAD_DIM": 1 << (build.head_dim - 1).bit_length(), "D": build.head_dim}
    if "CAUSAL" in sig:
        constexprs["CAUSAL"] = build.causal
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def compile_kernel(build: KernelBuild):
    """triton.compile the kernel for its target; returns the CompiledKernel."""
    import triton

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # explicit: it is in Triton's cache key
    return triton.compile(_source(build), target=build.target(),
                          options={"num_warps": build.num_warps, "num_stages": build.num_stages, **dict(build.options)})


def _nvidia_tool(name: str) -> str:
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cuobjdump(*args: str) -> str:
    """The output of the cuobjdump that Triton ships (SASS listings, resource usage), no GPU needed."""
    return subprocess.run([_nvidia_tool("cuobjdump"), *args], capture_output=True, text=True, check=True).stdout


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


def fingerprint(build: KernelBuild) -> str:
    """The cache key: attnforge version, generated source, triton version, target and variant."""
    import triton

    module, _ = _function(build)
    source = pathlib.Path(module.__file__).read_bytes()
    h = hashlib.sha256()
    for part in (__version__, triton.__version__, os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"), build.name(),
                 str(build.num_warps), str(build.num_stages), build.package, repr(build.options)):
        h.update(part.encode() + b"\0")
    h.update(source)
    return h.hexdigest()[:32]


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ATTNFORGE_CACHE_DIR", pathlib.Path.home() / ".cache" / "attnforge"))


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_entry(entry: pathlib.Path) -> dict | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        json.loads((entry / "triton.json").read_text())
        if (entry / meta["binary"]).stat().st_size != meta["binary_bytes"]:
            return None
        return meta
    except (OSError, ValueError, KeyError):
        return None


def load_cached(build: KernelBuild, cache_dir: pathlib.Path):
    """The CompiledKernel for ``build`` from the cache, ready to launch with no compilation, or None
    when the cache has no whole entry for it (this attnforge, source, Triton version and target)."""
    entry = pathlib.Path(cache_dir) / fingerprint(build)
    meta = _read_entry(entry)
    if meta is None:
        return None
    from triton.compiler.compiler import CompiledKernel

    name, binary = meta["kernel_name"], meta["binary"]
    return CompiledKernel(_source(build), {f"{name}.json": str(entry / "triton.json"),
                                           f"{name}{pathlib.Path(binary).suffix}": str(entry / binary)}, meta["key"])


def build_cached(build: KernelBuild, cache_dir: pathlib.Path, keep_asm: bool = False) -> tuple[dict, bool]:
    """Compile ``build`` into ``cache_dir`` unless a whole entry is there. Returns (meta, built_now)."""
    key = fingerprint(build)
    entry = cache_dir / key
    with _locked(cache_dir / "locks" / f"{key}.lock"):
        meta = _read_entry(entry)
        if meta is not None and (not keep_asm or meta.get("asm")):
            return meta, False
        if entry.exists():  # corrupt or partial: rebuild from scratch
            shutil.rmtree(entry)
        ck = compile_kernel(build)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
        binary_kind = "hsaco" if build.amd else "cubin"
        binary = ck.asm[binary_kind]
        (tmp / f"kernel.{binary_kind}").write_bytes(binary)
        if build.amd:  # the AMDGCN listing is small and holds the resource counts: always kept
            asm = {"kernel.amdgcn": ck.asm["amdgcn"]}
            res = amd_resources(asm["kernel.amdgcn"])
        else:
            res = resources(binary)
            asm = {"kernel.ptx": ck.asm["ptx"], "kernel.sass": ck.asm["sass"]} if keep_asm else {}
        for name, text in asm.items():
            (tmp / name).write_text(text)
        listing = next(iter(asm.values()), None) if build.amd else asm.get("kernel.sass")
        # Triton's own metadata, from which triton.compiler.CompiledKernel loads the cubin at run time.
        triton_json = next(p for name, p in ck.metadata_group.items() if name.endswith(".json"))
        shutil.copyfile(triton_json, tmp / "triton.json")
        meta = {"build": dataclasses.asdict(build), "key": key, "kernel_name": ck.metadata.name,
                "shared_bytes": ck.metadata.shared, "binary": f"kernel.{binary_kind}", "binary_bytes": len(binary),
                **res, "asm": sorted(asm), "instructions": instructions(listing) if listing else None}
        meta = json.loads(json.dumps(meta))  # as a later read will see it (tuples become lists)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        tmp.rename(entry)  # atomic: a reader sees no entry or a whole one
        return meta, True


BUILD_TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "gfx90a", "gfx942", "gfx950")


def plan(targets, dtypes=("fp16", "bf16"), head_dims=None, causal=(False, True)) -> list[KernelBuild]:
    """Every kernel triton_fa2 (NVIDIA targets) or triton_rocm (gfx targets) launches for these
    targets, dtypes, head dims and causal flags, from the variant tables' picks (what runs)."""
    from ..backends.triton_fa2 import variants
    from ..backends.triton_rocm import variants as rocm

    builds = {}
    for arch in targets:
        if arch not in BUILD_TARGETS:
            raise ValueError(f"unknown build target {arch!r}; targets: {', '.join(BUILD_TARGETS)}")
        table, package = (rocm, ROCM_PACKAGE) if arch.startswith("gfx") else (variants, FA2_PACKAGE)
        for head_dim in head_dims or variants.HEAD_DIMS:
            fwd, fwd_why = variants.pick(table.FWD, arch, head_dim)
            bwd, bwd_why = variants.pick(table.BWD, arch, head_dim)
            if fwd is None or bwd is None:
                raise ValueError(f"{arch} d={head_dim}: " + "; ".join(fwd_why + bwd_why))
            for dtype in dtypes:
                for is_causal in causal:
                    for tile, kernel in ((fwd, "fwd_kernel"), (bwd, "dkdv_kernel"), (bwd, "dq_kernel"),
                                         (bwd, "preprocess_kernel")):
                        flag = is_causal if kernel != "preprocess_kernel" else False  # it has no causal variant
                        options = tuple(sorted(tile.params().get("launch_options", {}).items()))
                        b = KernelBuild(tile.module, kernel, arch, dtype, head_dim, flag, tile.num_warps,
                                        tile.num_stages, package, options)
                        builds[b] = None
    return list(builds)


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


def cute_plan(targets, dtypes=("fp16", "bf16"), head_dims=None, causal=(False, True)) -> list[tuple[str, str, bool]]:
    """(module, dtype, causal) of every cute_sm90 kernel for these targets (sm90 only), from the variant
    table's picks. Unknown targets raise as plan() does."""
    from ..backends.cute_sm90 import compile as cc
    from ..backends.cute_sm90 import variants

    for arch in targets:
        if arch not in BUILD_TARGETS:
            raise ValueError(f"unknown build target {arch!r}; targets: {', '.join(BUILD_TARGETS)}")
    if "sm90" not in targets:
        return []
    out = []
    for dtype in dtypes:
        if dtype not in cc.DTYPES:
            raise ValueError(f"cute_sm90 builds {', '.join(cc.DTYPES)}, not {dtype!r}")
        for head_dim in head_dims or variants.HEAD_DIMS:
            tile, why = variants.pick(cc.KIND[dtype], head_dim)
            if tile is None:
                raise ValueError(f"cute_sm90 d={head_dim}: " + "; ".join(why))
            out += [(tile.module(head_dim, cc.KIND[dtype]), dtype, flag) for flag in causal]
    return out


def fp8_layout_plan(targets, dtypes) -> list[KernelBuild]:
    """cute_sm90's FP8 V^T kernel (Triton, head-dim generic) when the targets include sm90 and dtypes fp8."""
    if "sm90" not in targets or "fp8" not in dtypes:
        return []
    from ..backends.cute_sm90 import v_layout

    return [v_layout.aot_build("sm90")]


def cute_sm100_plan(targets, dtypes=("fp16", "bf16"), head_dims=None, causal=(False, True)) -> list[tuple[str, str, bool]]:
    """(module, dtype, causal) of every cute_sm100 kernel for these targets (sm100 only)."""
    from ..backends.cute_sm100 import compile as cc
    from ..backends.cute_sm100 import variants

    if "sm100" not in targets:
        return []
    out = []
    for dtype in dtypes:
        if dtype not in cc.DTYPES:
            continue  # fp8 is not built for sm100 yet
        for head_dim in head_dims or variants.HEAD_DIMS:
            tile, why = variants.pick(head_dim)
            if tile is None:
                raise ValueError(f"cute_sm100 d={head_dim}: " + "; ".join(why))
            out += [(tile.module(head_dim), dtype, flag) for flag in causal]
    return out


def run_cute(builds: list[tuple[str, str, bool]], cache_dir: pathlib.Path, progress=print,
             backend: str = "cute_sm90") -> None:
    """Compile (with no GPU if need be; in a child process when this one targets another arch) and export
    every kernel of ``builds`` for ``backend`` (cute_sm90 or cute_sm100) into the cache it loads from at
    run time, reporting each."""
    import time

    cc = importlib.import_module(f"..backends.{backend}.compile", __package__)
    for i, (module, dtype, causal) in enumerate(builds, 1):
        t0 = time.perf_counter()
        path, built = cc.build_cached(module, dtype, causal, cache_dir)
        what = f"built in {time.perf_counter() - t0:.1f}s" if built else "cached"
        progress(f"[{i}/{len(builds)}] {backend} {module}.{dtype}.{'causal' if causal else 'full'}: {what} ({path.name})")

"""Launching a Triton kernel: the prebuilt one from ``attnforge build``'s cache when there is one for this
kernel, target, dtype and head dim (so the first call compiles nothing), else Triton's JIT.

A launch is matched to a build by the kernel's file and name, the target, the dtype and the constexprs
``D`` (head dim; absent: a head-dim-generic kernel) and ``CAUSAL``, the names attnforge's kernels give
them, and by ``GROUP`` = 1 where the call passes 1 (triton_aot.AT_ONE: a build compiled for that call,
its sequence lengths as multiples of 16; a call it does not take runs the generic build).
A prebuilt kernel was compiled assuming 16-byte-aligned pointers, 32-bit integer arguments and row
strides that are multiples of 16 (triton_aot.Prebuilt.accepts); a call that breaks any goes to the JIT,
which specialises for it.
"""

from __future__ import annotations

import sys

import torch

from .cache import CacheError, default_cache_dir, warn_once
from .env import triton_interpret

_MISSING = object()
_PREBUILT: dict[tuple, object] = {}  # per process: (kernel, device, dtype name, constexprs, warps, stages) -> Prebuilt or None
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _arch(device: torch.device) -> str | None:
    """The sm arch of an NVIDIA device (None on AMD or anything else: those always JIT)."""
    if torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side of a launch. triton.cdiv and triton.next_power_of_2 are constexpr functions
    in recent Triton (3.9), whose call from Python unwraps its arguments first: ~1.7 us each on a 2-core EPYC VM, a
    tenth of a whole attention() call's host time there (benchmarks/host_python.py)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0, as Triton's), for the host side of a launch (see cdiv)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def module_name(fn) -> str:
    """The name a kernel's file is built under: a generated module's variant name, else the file's stem."""
    module = sys.modules.get(fn.__module__)
    name = getattr(module, "VARIANT_NAME", None)
    return name or fn.__module__.rsplit(".", 1)[-1]


def find_prebuilt(kernel, device: torch.device, dtype_name: str | None, constexprs: dict, num_warps: int,
                  num_stages: int, cache_dir=None):
    """The triton_aot.Prebuilt kernel ``attnforge build`` left in the cache for this launch, or None."""
    from .triton_aot import KernelBuild, load_cached

    if device.type != "cuda" or triton_interpret() or dtype_name is None:
        return None
    arch = _arch(device)
    if arch is None:
        return None
    fn = kernel.fn
    build = KernelBuild(fn.__globals__["__file__"], module_name(fn), fn.__name__, arch, dtype_name,
                        constexprs.get("D", 0), bool(constexprs.get("CAUSAL", False)), num_warps, num_stages,
                        constexprs=tuple(constexprs.items()))
    if cache_dir is None:
        try:
            cache_dir = default_cache_dir()
        except CacheError as exc:
            warn_once(f"no prebuilt Triton kernels are looked for: {exc}")
            return None
    return load_cached(build, cache_dir)


_AT_ONE_POSITIONS: dict = {}  # kernel -> ((position among a launch's arguments, name), ...) of its AT_ONE parameters


def at_one(kernel, args: tuple) -> dict:
    """{name: 1} for each triton_aot.AT_ONE parameter of ``kernel`` that ``args`` pass as 1: with the launch's
    constexprs, the constants of the prebuilt kernel compiled for this call, as the JIT would compile it."""
    positions = _AT_ONE_POSITIONS.get(kernel)
    if positions is None:
        from .triton_aot import AT_ONE

        names = [p.name for p in getattr(kernel, "params", ()) if not p.is_constexpr]
        positions = _AT_ONE_POSITIONS[kernel] = tuple((names.index(n), n) for n in AT_ONE if n in names)
    return {name: 1 for i, name in positions if args[i] == 1}


def launch(kernel, grid, args: tuple, constexprs: dict, num_warps: int, num_stages: int, *,
           dtype_name: str | None = None, **options) -> None:
    """Run ``kernel`` (a @triton.jit function whose constexpr parameters come last, in ``constexprs``'
    order) on ``grid``: the prebuilt one when the cache has it, else the JIT. ``dtype_name``: the dtype
    the build was named for (default: the first argument's, fp16 or bf16). ``options``: further compile
    options (AMD's waves_per_eu, matrix_instr_nonkdim); kernels with options always go through the JIT."""
    data = args[0]
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES.get(data.dtype)
    prebuilt = None
    if not options:
        ones = at_one(kernel, args)
        # the GROUP = 1 build for a call that passes 1, then (for a call it does not take: lengths that are not
        # multiples of 16, say) the generic one
        for built_ones in (ones, {}) if ones else ({},):
            found = _prebuilt(kernel, data.device, dtype_name, constexprs, num_warps, num_stages, built_ones)
            if found is not None and found.accepts(args):
                prebuilt = found
                break
    if prebuilt is not None:
        prebuilt.kernel[(*grid, 1, 1)[:3]](*args, *constexprs.values())  # CompiledKernel wants all three grid sides
    else:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)


def _prebuilt(kernel, device, dtype_name, constexprs: dict, num_warps: int, num_stages: int, ones: dict):
    """The prebuilt kernel for a launch (the build with ``ones``' parameters compiled as 1 where given), found once
    per process, or None."""
    built_as = {**constexprs, **ones} if ones else constexprs  # the build's constants: GROUP too where it is 1
    key = (kernel, device, dtype_name, tuple(built_as.items()), num_warps, num_stages)
    prebuilt = _PREBUILT.get(key, _MISSING)
    if prebuilt is _MISSING:
        prebuilt = _PREBUILT[key] = find_prebuilt(kernel, device, dtype_name, built_as, num_warps, num_stages)
    return prebuilt


def clear() -> None:
    """Forget which prebuilt kernels were found (after a new build in this process, or in tests)."""
    _PREBUILT.clear()
    _AT_ONE_POSITIONS.clear()

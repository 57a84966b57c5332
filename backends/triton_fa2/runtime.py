"""Launching a generated kernel: the prebuilt one from ``attnforge build``'s cache when there is
one for this kernel, target, dtype and head dim (so the first call compiles nothing), else
Triton's JIT.

A prebuilt kernel was compiled assuming 16-byte-aligned pointers and 32-bit integer arguments
(codegen/build.py's signature); a call that breaks either goes to the JIT, which specialises for it.
"""

from __future__ import annotations

import os

import torch

from ...dispatch.device import detect

_MISSING = object()
_PREBUILT: dict[tuple, object] = {}  # per process: (kernel, device, dtype name, constexprs, warps, stages) -> kernel or None
_INT32 = 2**31 - 1
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compatible(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.data_ptr() % 16:
                return False
        elif isinstance(a, int) and not -_INT32 <= a <= _INT32:
            return False
    return True


def find_prebuilt(kernel, device: torch.device, dtype_name: str | None, constexprs: dict, num_warps: int,
                  num_stages: int, cache_dir=None):
    """The CompiledKernel ``attnforge build`` left in the cache for this launch, or None. The build is
    named after the kernel's own module and package, its constexpr D (0: a head-dim-generic kernel) and
    CAUSAL, as codegen/build.py names what it compiles."""
    from ...codegen import build

    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or dtype_name is None:
        return None
    spec = detect(device)
    if spec.vendor != "nvidia":
        return None
    package, module = kernel.fn.__module__.rsplit(".", 1)
    kb = build.KernelBuild(module, kernel.fn.__name__, spec.arch, dtype_name, constexprs.get("D", 0),
                           bool(constexprs.get("CAUSAL", False)), num_warps, num_stages, package=package)
    return build.load_cached(kb, cache_dir or build.default_cache_dir())


def launch(kernel, grid, args: tuple, constexprs: dict, num_warps: int, num_stages: int, *,
           dtype_name: str | None = None, **options) -> None:
    """Run ``kernel`` (a @triton.jit function whose constexpr parameters come last, in ``constexprs``'
    order) on ``grid``: the prebuilt one when the cache has it, else the JIT. ``dtype_name``: the dtype
    the build was named for (default: the first argument's, fp16 or bf16). ``options``: further compile
    options (AMD's waves_per_eu, matrix_instr_nonkdim); kernels with options always go through the JIT."""
    data = args[0]
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES.get(data.dtype)
    key = (kernel, data.device, dtype_name, tuple(constexprs.items()), num_warps, num_stages)
    prebuilt = _PREBUILT.get(key, _MISSING)
    if prebuilt is _MISSING:
        prebuilt = _PREBUILT[key] = None if options else find_prebuilt(kernel, data.device, dtype_name, constexprs,
                                                                       num_warps, num_stages)
    if prebuilt is not None and _compatible(args):
        prebuilt[(*grid, 1, 1)[:3]](*args, *constexprs.values())  # CompiledKernel wants all three grid sides
    else:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **options)


def clear() -> None:
    """Forget which prebuilt kernels were found (after a new build in this process, or in tests)."""
    _PREBUILT.clear()

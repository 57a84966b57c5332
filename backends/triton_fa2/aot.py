"""What `attnforge build` compiles for a triton_fa2 (or triton_rocm) variant: each kernel of its module as a
runtime.triton_aot.KernelBuild, with the signature the module's launch() calls it with."""

from __future__ import annotations

from ...runtime.triton_aot import KernelBuild, kernel_function

# Pointer arguments that hold fp32 whatever the inputs' dtype; every other pointer holds the data dtype.
FP32_POINTERS = {"LSE", "DELTA", "SINKS", "SLOPES"}
# Upper-case parameters that are sizes, not pointers.
SIZES = ("B", "H", "GROUP", "N_Q", "N_K")
TRITON_DTYPES = {"fp16": "fp16", "bf16": "bf16"}
KERNELS = {"fwd": ("fwd_kernel",), "bwd": ("dkdv_kernel", "dq_kernel", "preprocess_kernel")}


def signature(fn, dtype: str) -> tuple[tuple, tuple]:
    """(signature, aligned pointers) of a generated kernel as the JIT sees it for 16-byte-aligned tensors:
    upper-case parameters are pointers (fp32 for LSE and DELTA), ``*scale*`` are fp32, the rest i32."""
    sig, aligned = [], []
    for p in fn.params:
        if p.is_constexpr:
            sig.append((p.name, "constexpr"))
        elif p.name.isupper() and p.name not in SIZES:
            sig.append((p.name, "*fp32" if p.name in FP32_POINTERS else f"*{TRITON_DTYPES[dtype]}"))
            aligned.append(p.name)
        elif "scale" in p.name:
            sig.append((p.name, "fp32"))
        else:
            sig.append((p.name, "i32"))
    return tuple(sig), tuple(aligned)


def builds(variant, path) -> list[KernelBuild]:
    """Every kernel of ``variant``'s module (rendered at ``path``), as its launch() specialises them."""
    tile, out = variant.tile, []
    options = tuple(sorted(tile.params().get("launch_options", {}).items()))
    pad = 1 << (variant.head_dim - 1).bit_length()
    for kernel in KERNELS[variant.family]:
        fn = kernel_function(str(path), kernel)
        sig, aligned = signature(fn, variant.dtype)
        names = dict(sig)
        # the feature flags as launch() passes them, in its order, where the kernel has them (preprocess has none);
        # a LOCAL kernel takes its window as arguments, with CAUSAL off (folded into it)
        flags = {"CAUSAL": variant.causal and not variant.local, "LOCAL": variant.local, "SOFTCAP": variant.softcap,
                 "HAS_SINKS": variant.sinks, "ALIBI": variant.alibi}
        flags = {name: on for name, on in flags.items() if name in names}
        causal = flags.get("CAUSAL", False)
        constexprs = (("HEAD_DIM", pad), ("D", variant.head_dim)) + tuple(flags.items())
        out.append(KernelBuild(str(path), tile.module, kernel, variant.arch, variant.dtype, variant.head_dim, causal,
                               tile.num_warps, tile.num_stages, sig, constexprs, aligned, options))
    return out

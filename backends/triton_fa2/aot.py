"""What `attnforge build` compiles for a triton_fa2 (or triton_rocm) variant: each kernel of its module as a
runtime.triton_aot.KernelBuild, with the signature the module's launch() calls it with."""

from __future__ import annotations

import dataclasses

from ...runtime.triton_aot import AT_ONE, COMMON_MULTIPLES_OF_16, KernelBuild, kernel_function

# Pointer arguments that hold fp32 or int32 whatever the inputs' dtype; every other pointer holds the data dtype.
FP32_POINTERS = {"LSE", "DELTA", "SINKS", "SLOPES", "O_PART", "LSE_PART", "DESCALE"}
INT32_POINTERS = {"SEQLENS", "LEFTPAD", "BLOCK_TABLE"}
# A packed batch's row offsets: int32 in VARLEN kernels; the others get the (fp32) LSE as an unused stand-in.
OFFSET_POINTERS = {"CU_Q", "CU_K"}
# Upper-case parameters that are sizes, not pointers.
SIZES = ("B", "H", "GROUP", "N_Q", "N_K", "H_KV", "PAGE_SIZE", "KEYS_PER_SPLIT", "NUM_SPLITS", "CAPACITY", "NUM_PAGES",
         "B_H_KV")
# Integer parameters compiled as multiples of 16 (where the head dim is one): the row strides of head-dim-wide tensors
# (q, k, v, o, their gradients, the split partials). Triton's JIT specialises every integer argument that is a
# multiple of 16 so, and only then can it prove a tile's rows 16-byte aligned: without it a prebuilt kernel loads
# K and V element by element and does not pipeline them (sm90 SASS: 2-byte LDG instead of 16-byte cp.async, in the
# backward and KV-cache kernels). Strides that need not be multiples of 16 in a common call stay plain: a block
# table's row (its sequences' page count), the split LSE's (batch x heads x queries) and the ALiBi slopes' (heads).
UNALIGNED_STRIDES = {"stride_bt", "stride_ls", "stride_slopes"}
# An fp8 KV cache's K and V (the KV-cache kernel's FP8_KV), by Problem.kv_dtype: e4m3 is Triton's fp8e4nv,
# e4m3fnuz its fp8e4b8.
CACHE_POINTERS = {"K", "V"}
CACHE_TRITON_DTYPES = {"fp8": "fp8e4nv", "fp8_fnuz": "fp8e4b8"}
TRITON_DTYPES = {"fp16": "fp16", "bf16": "bf16"}
KERNELS = {"fwd": ("fwd_kernel",), "bwd": ("dkdv_kernel", "dq_kernel", "preprocess_kernel"),
           "kvcache": ("kvcache_kernel", "combine_kernel")}
# The KV-cache module's launch() specialisations that are built ahead of time: the kernel writing the output
# itself (one split) or fp32 partials, for the variant's cache layout, without left padding (padded calls JIT);
# the combine for these split counts' powers of two (variants.MAX_SPLITS at most).
KV_SPLIT_POWERS = (2, 4, 8, 16, 32, 64, 128)


def signature(fn, dtype: str, head_dim: int, fp32_out: bool = False, varlen: bool = False,
              kv_dtype: str = "") -> tuple[tuple, tuple]:
    """(signature, aligned parameters) of a generated kernel as the JIT sees it for 16-byte-aligned tensors whose
    rows are 16-byte aligned: upper-case parameters are pointers (fp32 for LSE and DELTA; O too with ``fp32_out``;
    int32 for lengths and block tables, and for a packed batch's offsets with ``varlen``; K and V in the fp8 cache
    format ``kv_dtype`` names), ``*scale*`` are fp32, the rest i32; aligned are the pointers and, where
    ``head_dim`` is a multiple of 16, the row strides (UNALIGNED_STRIDES above)."""
    sig, aligned = [], []
    for p in fn.params:
        if p.is_constexpr:
            sig.append((p.name, "constexpr"))
        elif p.name.isupper() and p.name not in SIZES:
            offsets = "i32" if varlen else "fp32"
            kind = ("fp32" if p.name in FP32_POINTERS or (fp32_out and p.name == "O") else
                    CACHE_TRITON_DTYPES[kv_dtype] if kv_dtype and p.name in CACHE_POINTERS else
                    offsets if p.name in OFFSET_POINTERS else
                    "i32" if p.name in INT32_POINTERS else TRITON_DTYPES[dtype])
            sig.append((p.name, f"*{kind}"))
            aligned.append(p.name)
        elif "scale" in p.name:
            sig.append((p.name, "fp32"))
        else:
            sig.append((p.name, "i32"))
            if p.name.startswith("stride_") and p.name not in UNALIGNED_STRIDES and head_dim % 16 == 0:
                aligned.append(p.name)
    return tuple(sig), tuple(aligned)


def builds(variant, path) -> list[KernelBuild]:
    """Every kernel of ``variant``'s module (rendered at ``path``), as its launch() specialises them."""
    if variant.family == "kvcache":
        return kvcache_builds(variant, path)
    tile, out = variant.tile, []
    options = tuple(sorted(tile.params().get("launch_options", {}).items()))
    pad = 1 << (variant.head_dim - 1).bit_length()
    for kernel in KERNELS[variant.family]:
        fn = kernel_function(str(path), kernel)
        sig, aligned = signature(fn, variant.dtype, variant.head_dim, varlen=variant.varlen)
        names = dict(sig)
        # the feature flags as launch() passes them, in its order, where the kernel has them (preprocess: VARLEN);
        # a LOCAL kernel takes its window as arguments, with CAUSAL off (folded into it)
        flags = {"CAUSAL": variant.causal and not variant.local, "LOCAL": variant.local, "SOFTCAP": variant.softcap,
                 "HAS_SINKS": variant.sinks, "ALIBI": variant.alibi, "VARLEN": variant.varlen}
        flags = {name: on for name, on in flags.items() if name in names}
        causal = flags.get("CAUSAL", False)
        constexprs = (("HEAD_DIM", pad), ("D", variant.head_dim)) + tuple(flags.items())
        build = KernelBuild(str(path), tile.module, kernel, variant.arch, variant.dtype, variant.head_dim, causal,
                            tile.num_warps, tile.num_stages, sig, constexprs, aligned, options)
        out += [build, *at_one(build)]
    return out


def at_one(build: KernelBuild) -> list[KernelBuild]:
    """``build`` compiled for the common call as the JIT compiles it (triton_aot.AT_ONE, COMMON_MULTIPLES_OF_16):
    GROUP = 1 (no grouped-query attention) and the sequence lengths multiples of 16. For NVIDIA targets, whose
    launches load prebuilt kernels, where the kernel has GROUP; a call this build does not take runs ``build``."""
    names = [name for name, _ in build.signature if name in AT_ONE]
    if build.amd or not names:
        return []
    signature = tuple((name, "constexpr" if name in names else kind) for name, kind in build.signature)
    sizes = tuple(name for name, _ in build.signature if name in COMMON_MULTIPLES_OF_16)
    return [dataclasses.replace(build, signature=signature, constexprs=build.constexprs + tuple((n, 1) for n in names),
                                aligned=build.aligned + sizes)]


def kvcache_builds(variant, path) -> list[KernelBuild]:
    """The KV-cache module's kernels as its launch() specialises them (KV_SPLIT_POWERS above)."""
    tile, out = variant.tile, []
    pad = 1 << (variant.head_dim - 1).bit_length()
    head = (("HEAD_DIM", pad), ("D", variant.head_dim))
    fn = kernel_function(str(path), "kvcache_kernel")
    flags = (("CAUSAL", variant.causal and not variant.local), ("LOCAL", variant.local), ("SOFTCAP", variant.softcap),
             ("HAS_SINKS", variant.sinks))
    for fp32_out in (False, True):
        sig, aligned = signature(fn, variant.dtype, variant.head_dim, fp32_out, kv_dtype=variant.kv_dtype)
        for paged in (variant.paged,):
            constexprs = head + flags + (("PAGED", paged), ("HAS_LEFTPAD", False), ("SPLIT", fp32_out),
                                         ("FP8_KV", variant.fp8_kv))
            out.append(KernelBuild(str(path), tile.module, "kvcache_kernel", variant.arch, variant.dtype,
                                   variant.head_dim, dict(flags)["CAUSAL"], tile.num_warps, tile.num_stages, sig,
                                   constexprs, aligned, ()))
    fn = kernel_function(str(path), "combine_kernel")
    sig, aligned = signature(fn, variant.dtype, variant.head_dim)
    for splits in KV_SPLIT_POWERS:
        out.append(KernelBuild(str(path), tile.module, "combine_kernel", variant.arch, variant.dtype, variant.head_dim,
                               False, 4, 1, sig, (("SPLITS", splits),) + head, aligned, ()))
    return out

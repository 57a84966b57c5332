"""FP8 V for cute_sm90's P @ V: V^T with the keys of every 32-key block permuted (key_of_slot below).

FP8 WGMMA wants both operands K-major, so P @ V reads V as (head_dim, keys) with keys contiguous; and P
comes straight from the accumulator registers, whose key order the permutation matches. On a GPU this is
one Triton kernel (v_layout_kernel.py) that reads V once and writes V^T once: the one `attnforge build
--target sm90 --dtype fp8` prebuilt when the cache has it, else Triton's JIT. torch's strided
permute-and-copy of the same layout took 0.11-0.21 ms at 16k tokens on the H200
(benchmarks/results/2026-11-29-h200-cute_sm90-fp8/), several times what its bytes need. Elsewhere (CPU
tests) the torch version runs, and it is the reference the Triton kernel is tested against.
"""

from __future__ import annotations

import torch

KEY_BLOCK = 32  # the permutation repeats every 32 keys (one e4m3 WGMMA K step)


def key_of_slot(slot: int) -> int:
    """Slot ``slot`` of a 32-key block holds this key: slot k = 16h + 4c + 2a + b holds 16h + 8a + 2c + b."""
    return 16 * (slot // 16) + 8 * ((slot % 4) // 2) + 2 * ((slot % 16) // 4) + slot % 2


def padded_keys(seqlen: int) -> int:
    return -(-seqlen // KEY_BLOCK) * KEY_BLOCK


def prepare_v_fp8_torch(v: torch.Tensor) -> torch.Tensor:
    """The torch version: V (batch, heads_kv, seqlen_k, head_dim) e4m3 -> V^T (batch, heads_kv, head_dim,
    seqlen_k padded to 32, zero keys) in the permuted key order. One strided copy."""
    b, h, n, d = v.shape
    padded = padded_keys(n)
    raw = v.view(torch.uint8)  # copy and pad kernels are not all built for float8 dtypes
    if padded != n:  # zero keys: masked in S, and 0 * V adds nothing
        raw = torch.nn.functional.pad(raw, (0, 0, 0, padded - n))
    # keys as (block, h, a, c, b) -> slots as (block, h, c, a, b), with head_dim moved in front
    keys = raw.reshape(b, h, padded // KEY_BLOCK, 2, 2, 4, 2, d)
    return keys.permute(0, 1, 7, 2, 3, 5, 4, 6).reshape(b, h, d, padded).view(v.dtype)


def prepare_v_fp8(v: torch.Tensor, use_triton: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """V^T in the permuted key order, zero-padded to 32 keys: the Triton kernel on CUDA (``use_triton``:
    force it, e.g. in Triton's interpreter on CPU), torch elsewhere. ``out``: a contiguous uint8
    (batch, heads_kv, head_dim, padded) tensor to write (Triton only; tests poison it)."""
    if not (v.is_cuda if use_triton is None else use_triton):
        return prepare_v_fp8_torch(v)
    from . import v_layout_kernel as k

    b, h, n, d = v.shape
    padded = padded_keys(n)
    raw = v.view(torch.uint8)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    if out is None:
        out = torch.empty(b, h, d, padded, dtype=torch.uint8, device=v.device)
    if out.numel():
        from ...runtime.triton_launch import launch

        grid = (-(-padded // k.BLOCK_KEYS), -(-d // k.BLOCK_DIMS), b * h)
        args = (raw, out, n, padded, d, h, raw.stride(0), raw.stride(1), raw.stride(2))
        launch(k.transpose_permute_keys, grid, args, dict(k.AOT_CONSTEXPRS), k.NUM_WARPS, k.NUM_STAGES,
               dtype_name="fp8")
    return out.view(v.dtype)


def aot_build(arch: str = "sm90"):
    """The KernelBuild `attnforge build` compiles for this kernel (head-dim generic: head_dim 0), named as
    runtime.triton_launch looks it up."""
    from ...runtime.triton_aot import KernelBuild
    from . import v_layout_kernel as k

    return KernelBuild(k.__file__, "v_layout_kernel", "transpose_permute_keys", arch, "fp8", 0, False, k.NUM_WARPS,
                       k.NUM_STAGES, signature=tuple(k.AOT_SIGNATURE.items()), constexprs=tuple(k.AOT_CONSTEXPRS.items()),
                       aligned=k.AOT_ALIGNED)

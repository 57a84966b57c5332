"""FP8 V for cute_sm90's P @ V: V^T with the keys of every 32-key block permuted (key_of_slot below).

FP8 WGMMA wants both operands K-major, so P @ V reads V as (head_dim, keys) with keys contiguous; and P
comes straight from the accumulator registers, whose key order the permutation matches. On a GPU this is
one Triton kernel that reads V once and writes V^T once; torch's strided permute-and-copy of the same
layout took 0.11-0.21 ms at 16k tokens on the H200 (benchmarks/results/2026-11-29-h200-cute_sm90-fp8/),
several times what its bytes need. Elsewhere (CPU tests) the torch version runs, and it is the
reference the Triton kernel is tested against.
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
    b, h, n, d = v.shape
    padded = padded_keys(n)
    raw = v.view(torch.uint8)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    if out is None:
        out = torch.empty(b, h, d, padded, dtype=torch.uint8, device=v.device)
    if out.numel():
        grid = (-(-padded // BLOCK_KEYS), -(-d // BLOCK_DIMS), b * h)
        _kernel()[grid](raw, out, n, padded, d, h, raw.stride(0), raw.stride(1), raw.stride(2),
                        BLOCK_KEYS=BLOCK_KEYS, BLOCK_DIMS=BLOCK_DIMS)
    return out.view(v.dtype)


# Keys x head dims per program. H200, 16k tokens (benchmarks/results/2026-11-29-h200-cute_sm90-session3/
# v_layout.json): 128x64 took 21-24 us at d=64/128/256 (~3 TB/s), within 2% of the best shape at each
# (64x128 at d=128: 22.2 us vs 22.6); torch's strided copy took 115-207 us.
BLOCK_KEYS, BLOCK_DIMS = 128, 64
_KERNEL = None


def _kernel():
    """The Triton kernel, defined on first use (importing triton costs ~1 s)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def transpose_permute_keys(v_ptr, out_ptr, seqlen, padded, head_dim, heads, stride_b, stride_h, stride_n,
                                   BLOCK_KEYS: tl.constexpr, BLOCK_DIMS: tl.constexpr):
            pid_keys, pid_dims, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
            slots = pid_keys * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
            s = slots % 32
            keys = slots - s + 16 * (s // 16) + 8 * ((s % 4) // 2) + 2 * ((s % 16) // 4) + s % 2  # key_of_slot
            dims = pid_dims * BLOCK_DIMS + tl.arange(0, BLOCK_DIMS)
            batch, head = pid_bh // heads, pid_bh % heads
            src = (v_ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
                   + keys.to(tl.int64)[:, None] * stride_n + dims[None, :])
            tile = tl.load(src, mask=(keys[:, None] < seqlen) & (dims[None, :] < head_dim), other=0)
            dst = out_ptr + pid_bh.to(tl.int64) * head_dim * padded + dims.to(tl.int64)[:, None] * padded + slots[None, :]
            tl.store(dst, tl.trans(tile), mask=(dims[:, None] < head_dim) & (slots[None, :] < padded))

        _KERNEL = transpose_permute_keys
    return _KERNEL

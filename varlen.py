"""Variable-length (packed) batches with FlashAttention's names and layouts: ``attention_varlen``.

Sequences are packed along the first dim, (total_tokens, heads, head_dim), and delimited by int32
``cu_seqlens`` (batch + 1 offsets from 0), as ``flash_attn_varlen_func`` takes them. Each sequence runs as its
own ``attention()`` call (layout "bshd", a view of the packed tensors: no copy, no padding), so every backend,
mask and variant the dense call has applies, with a Decision per sequence shape. There is no varlen kernel yet:
the calls are made one after another (one launch or more per sequence), which costs host time on batches of
many short sequences.
"""

from __future__ import annotations

import torch

from .errors import InvalidInputError


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                     backend: str | None = None):
    """Attention over a packed batch: sequence i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q against rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of k and v, with attention()'s semantics (``causal`` bottom-right per
    sequence, ``window_size``, ``scale`` default 1/sqrt(head_dim), GQA).

    q: (total_q, heads_q, head_dim), k: (total_k, heads_kv, head_dim), v: (total_k, heads_kv, head_dim_v);
    cu_seqlens_*: int32 (batch + 1,) offsets from 0 to total, non-decreasing (zero-length sequences allowed);
    ``max_seqlen_*``: at least the longest sequence (checked). Returns the output (total_q, heads_q, head_dim_v)
    and with ``return_lse`` the natural-log LSE (heads_q, total_q) in fp32, -inf for rows that see no key.
    Differentiable (the LSE too). Reads the offsets on the host (one device sync); not under torch.compile yet.
    """
    from .api import attention
    from .op import lse_dtype

    if torch.compiler.is_compiling():
        raise InvalidInputError("attention_varlen inside torch.compile is not supported yet (it reads cu_seqlens on "
                                "the host); call it eagerly")
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise InvalidInputError(f"{name} must be a (total_tokens, heads, head_dim) tensor, got "
                                    f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape[0] != v.shape[0]:
        raise InvalidInputError(f"k has {k.shape[0]} tokens and v {v.shape[0]}: they must be packed alike")
    bounds_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    bounds_k = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(bounds_q) != len(bounds_k):
        raise InvalidInputError(f"cu_seqlens_q has {len(bounds_q) - 1} sequences and cu_seqlens_k "
                                f"{len(bounds_k) - 1}: they must have the same batch")
    _check_max("max_seqlen_q", max_seqlen_q, bounds_q)
    _check_max("max_seqlen_k", max_seqlen_k, bounds_k)
    outs, lses = [], []
    for (qa, qb), (ka, kb) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if qb == qa:
            continue  # no query rows: nothing to compute or return
        if kb == ka:  # no key: every row gives 0 and LSE -inf (attention()'s rule for a row that sees no key)
            outs.append(q.new_zeros((qb - qa, q.shape[1], v.shape[2])))  # (no gradient reaches q from these rows)
            lses.append(torch.full((q.shape[1], qb - qa), float("-inf"), device=q.device, dtype=lse_dtype(q)))
            continue
        out, lse = attention(q[qa:qb].unsqueeze(0), k[ka:kb].unsqueeze(0), v[ka:kb].unsqueeze(0), causal=causal, scale=scale,
                             layout="bshd", window_size=window_size, return_lse=True, backend=backend)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # every sequence has no query row
        out = q.new_zeros((0, q.shape[1], v.shape[2]))
        lse = torch.zeros((q.shape[1], 0), device=q.device, dtype=lse_dtype(q))
    else:
        out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
    return (out, lse) if return_lse else out


def _offsets(name: str, cu: torch.Tensor, total: int, device) -> list[int]:
    """``cu`` as host ints, after checking it is what flash-attn takes: int32, 1-D, from 0 to ``total``,
    non-decreasing, on q's device."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise InvalidInputError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                                f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        raise InvalidInputError(f"{name} is on {cu.device} but q is on {device}")
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise InvalidInputError(f"{name} must go from 0 to the packed length {total} without decreasing, got "
                                f"{bounds if len(bounds) <= 16 else bounds[:8] + ['...'] + bounds[-4:]}")
    return bounds


def _check_max(name: str, value, bounds: list[int]) -> None:
    longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    if isinstance(value, bool) or not isinstance(value, int) or value < longest:
        raise InvalidInputError(f"{name} must be an int at least the longest sequence ({longest}), got {value!r}")

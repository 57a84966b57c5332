"""Attention against a KV cache, with FlashAttention's names and layouts: ``attention_with_kvcache``.

Contiguous caches (batch, max_seqlen, heads_kv, head_dim) or paged ones (num_blocks, page_size, heads_kv,
head_dim) with an int32 ``block_table`` (batch, max_pages); new keys and values are written into the cache in
place at ``cache_seqlens`` first, as flash-attn does. The call is then one dispatched Problem (``kv_cache``
"contiguous" or "paged"): triton_fa2 and triton_rocm run a split-KV, pack-GQA kernel that reads the cache where
it lies (templates/triton_kvcache.py.jinja); reference, the last resort, gathers each sequence's keys.
"""

from __future__ import annotations

import torch

from .api import _causal_mask
from .dispatch.call import Call, KVCache
from .dispatch.device import detect
from .dispatch.problem import (Problem, check_scale, check_sinks, check_softcap, dtype_name, kv_dtype_of,
                               softcap_fields)
from .dispatch.registry import get
from .dispatch.select import decide_keyed, forced_backend
from .errors import InvalidInputError


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None, *, cache_seqlens: torch.Tensor | int | None = None,
                           block_table: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                           causal: bool = False, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, sinks: torch.Tensor | None = None, num_splits: int = 0,
                           return_lse: bool = False, backend: str | None = None, check_inputs: bool = True,
                           k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None):
    """Attention of q (batch, seqlen_q, heads_q, head_dim) against each sequence's cached keys and values.

    ``cache_seqlens``: (batch,) int32 or an int: the cache position each sequence's keys end at (default: the
    whole cache). ``k``, ``v`` (batch, seqlen_new, heads_kv, head_dim), if given, are written into the cache at
    those positions (in place) and attended too. ``cache_leftpad`` (batch,) int32: the first valid cache position
    per sequence. ``block_table`` (batch, max_pages) int32 makes the caches paged (page ``block_table[b, i]``
    holds positions ``i * page_size ...``). ``causal`` aligns bottom-right: query i sits at position
    ``len + i - seqlen_q`` of the ``len`` keys it attends; ``window_size``, ``softcap`` and ``sinks`` are
    attention()'s. ``num_splits``: how many chunks each sequence's keys are split into (flash-decoding); 0 lets
    the backend choose from the multiprocessor count. Returns the output (batch, seqlen_q, heads_q, head_dim_v),
    and with ``return_lse`` the LSE (batch, heads_q, seqlen_q) fp32. No backward (as flash-attn's). Under
    torch.compile(fullgraph=True) the call is one custom op (``attnforge::attention_with_kvcache``, or
    ``attention_with_kvcache_append`` with new ``k``, ``v``: a mutation of the caches), which reads and checks the
    lengths when the graph runs and decides as an eager call would.

    An fp8 cache: ``k_cache`` and ``v_cache`` float8_e4m3fn, or float8_e4m3fnuz (AMD CDNA3's fp8), with fp16/bf16
    ``q`` (and new ``k``, ``v`` in the cache's dtype too, quantised by the caller); ``k_descale`` and ``v_descale``
    (batch, heads_kv) fp32 (default 1) dequantise it: the keys and values attended are cache * descale. The output is
    in q's dtype.

    ``check_inputs`` (default): the lengths, left pads and the pages they use are checked on the host (one sync),
    and a value outside the cache raises. ``check_inputs=False`` reads nothing on the host, so the call can be
    captured in a CUDA graph (a serving loop's decode step): the Triton kernels then read nothing outside the cache
    whatever the values, and a sequence whose lengths leave the cache, or whose block table names a page that is
    not there, gets NaN rows; appends are clamped into the cache. The keys are split for the cache's capacity
    rather than the longest sequence then.
    """
    _check_tensors(q, k_cache, v_cache, k, v)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v, sinks)):
        raise InvalidInputError("attention_with_kvcache has no backward (as flash-attn's): call it under "
                                "torch.no_grad(), or use attention() or attention_varlen() to train")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise InvalidInputError(f"num_splits must be an int >= 0 (0: chosen for the device), got {num_splits!r}")
    if not isinstance(check_inputs, bool):
        raise InvalidInputError(f"check_inputs must be True or False, got {check_inputs!r}")
    mask = _causal_mask(causal, window_size)
    softcap = check_softcap(softcap)
    if sinks is not None:
        check_sinks(sinks, q, "bshd")
    if torch.compiler.is_compiling():
        return _traced(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal, scale, window_size,
                       softcap, sinks, num_splits, return_lse, backend, check_inputs, k_descale, v_descale)
    descale = _descales(q, k_cache, k_descale, v_descale)
    batch, seqlen_q, heads_q, head_dim = q.shape
    paged = block_table is not None
    pages = k_cache.shape[0]
    page_size = k_cache.shape[1]
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch or block_table.device != q.device:
            raise InvalidInputError(f"block_table must be an int32 (batch, max_pages) = ({batch}, ...) tensor on "
                                    f"{q.device}, got {getattr(block_table, 'dtype', None)} "
                                    f"{tuple(getattr(block_table, 'shape', ()))}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] < batch:
            raise InvalidInputError(f"k_cache has {k_cache.shape[0]} sequences for a batch of {batch}")
        capacity = page_size
    new = 0 if k is None else k.shape[1]
    device = q.device
    ends = _lengths("cache_seqlens", cache_seqlens, batch, capacity, device)
    starts = _lengths("cache_leftpad", cache_leftpad, batch, capacity, device) if cache_leftpad is not None else None
    if check_inputs:
        longest = _checked_longest(ends, starts, block_table, new, capacity, pages, page_size)
    else:
        longest = capacity
    if k is not None:
        _append(k_cache, k, ends, block_table)
        _append(v_cache, v, ends, block_table)
        ends = ends + new
    forced = forced_backend(backend)
    key = ("kvcache", q.shape, k_cache.shape, v_cache.shape, q.dtype, k_cache.dtype, device, paged, longest, mask,
           softcap, sinks is not None, bool(return_lse), starts is not None, check_inputs, forced)
    decision = decide_keyed(key, lambda: Problem(
        batch=batch, heads_q=heads_q, heads_kv=k_cache.shape[2], seqlen_q=seqlen_q, seqlen_k=longest,
        head_dim=head_dim, head_dim_v=v_cache.shape[3], dtype=dtype_name(q.dtype), device=detect(device), mask=mask,
        return_lse=bool(return_lse), **softcap_fields(softcap), sinks=sinks is not None,
        kv_cache="paged" if paged else "contiguous", kv_dtype=kv_dtype_of(k_cache.dtype),
        kv_page_size=page_size if paged else 0, kv_leftpad=starts is not None, kv_unchecked=not check_inputs), *forced)
    cache = KVCache(ends.to(torch.int32), starts, block_table, longest, num_splits, descale)
    call = Call(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                check_scale(scale, head_dim), mask, softcap=softcap, sinks=sinks, cache=cache)
    out, lse = get(decision.forward.backend).forward(decision.forward.variant, call)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _traced(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal, scale, window_size, softcap,
            sinks, num_splits, return_lse, backend, check_inputs, k_descale, v_descale):
    """Under torch.compile: the call as one custom op (op.attention_with_kvcache_op, or its _append form, which
    writes k and v into the caches), which runs this function eagerly when the graph runs: the lengths and pages
    are read and checked then, never while tracing."""
    from . import op

    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        tensor, value = cache_seqlens, -1
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) and cache_seqlens >= 0:
        tensor, value = None, cache_seqlens
    else:
        raise InvalidInputError(f"cache_seqlens must be an int >= 0 or an int32 (batch,) tensor, got {cache_seqlens!r}")
    args = (tensor, value, block_table, cache_leftpad, bool(causal), scale, *window_size, softcap, sinks, num_splits,
            check_inputs, k_descale, v_descale, backend)
    if k is None:
        out, lse = op.attention_with_kvcache_op(q, k_cache, v_cache, *args)
    else:
        out, lse = op.attention_with_kvcache_append_op(q, k_cache, v_cache, k, v, *args)
    return (out, lse) if return_lse else out


def _check_tensors(q, k_cache, v_cache, k, v) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None and name in ("k", "v"):
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidInputError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != q.device:
            raise InvalidInputError(f"{name} is on {t.device} but q is on {q.device}: they must share one device")
    fp8 = bool(kv_dtype_of(k_cache.dtype))
    if fp8 and q.dtype not in (torch.float16, torch.bfloat16):
        raise InvalidInputError(f"an fp8 KV cache takes fp16 or bf16 queries, got q {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        if fp8 and t.dtype != k_cache.dtype:
            raise InvalidInputError(f"{name} is {t.dtype}: with a {k_cache.dtype} k_cache, v_cache and new k, v are "
                                    f"{k_cache.dtype} too")
        if not fp8 and t.dtype != q.dtype:
            raise InvalidInputError(f"{name} is {t.dtype} but q is {q.dtype}: they must share one dtype (or the caches "
                                    "and new k, v are float8_e4m3fn or float8_e4m3fnuz, with fp16/bf16 q)")
    if (k is None) != (v is None):
        raise InvalidInputError("pass k and v together, or neither")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise InvalidInputError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the "
                                f"same blocks, positions and heads")
    heads_kv = k_cache.shape[2]
    if q.shape[3] != k_cache.shape[3]:
        raise InvalidInputError(f"q and k_cache must have the same head_dim, got {q.shape[3]} and {k_cache.shape[3]}")
    if heads_kv == 0 or q.shape[2] % heads_kv:
        raise InvalidInputError(f"heads of q ({q.shape[2]}) must be a multiple of the cache's heads ({heads_kv})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise InvalidInputError("k_cache and v_cache must have unit stride in head_dim (they are read and written "
                                "in place)")
    if k is not None and (k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2] or k.shape[2:] != k_cache.shape[2:]
                          or v.shape[2:] != v_cache.shape[2:]):
        raise InvalidInputError(f"k and v must be (batch, seqlen_new, heads_kv, head_dim) like the caches with batch "
                                f"{q.shape[0]}, got {tuple(k.shape)} and {tuple(v.shape)}")


def _descales(q, k_cache, k_descale, v_descale) -> torch.Tensor | None:
    """The (2, batch, heads_kv) fp32 descales of an fp8 cache (ones where not given); None for another cache, where
    giving one is an error."""
    if not kv_dtype_of(k_cache.dtype):
        if k_descale is not None or v_descale is not None:
            raise InvalidInputError(f"k_descale and v_descale apply to a float8_e4m3fn or float8_e4m3fnuz cache, got "
                                    f"{k_cache.dtype}")
        return None
    batch, heads_kv = q.shape[0], k_cache.shape[2]
    out = torch.ones(2, batch, heads_kv, dtype=torch.float32, device=q.device)
    for i, (name, d) in enumerate((("k_descale", k_descale), ("v_descale", v_descale))):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or tuple(d.shape) != (batch, heads_kv) or not d.is_floating_point():
            raise InvalidInputError(f"{name} must be a float tensor of shape (batch, heads_kv) = ({batch}, {heads_kv}), "
                                    f"got {getattr(d, 'shape', type(d).__name__)}")
        if d.device != q.device:
            raise InvalidInputError(f"{name} is on {d.device} but q is on {q.device}")
        out[i] = d.to(torch.float32)
    return out


def _checked_longest(ends, starts, block_table, new: int, capacity: int, pages: int, page_size: int) -> int:
    """The most keys a sequence has after the append, after checking on the host (one read) that every length,
    left pad and used page lies inside the cache."""
    batch = ends.shape[0]
    stats = [ends, starts if starts is not None else torch.zeros_like(ends)]
    if block_table is not None:
        stats.append(_used_pages(block_table, ends + new, page_size))
    host = torch.cat(stats).tolist()
    end_list, start_list = host[:batch], host[batch:2 * batch]
    if any(n < 0 or n > capacity for n in end_list + start_list):
        raise InvalidInputError(f"cache_seqlens and cache_leftpad must be between 0 and the cache's {capacity} "
                                f"tokens, got {end_list} and {start_list}")
    if any(a > e for a, e in zip(start_list, end_list)):
        raise InvalidInputError(f"cache_leftpad {start_list} must not pass cache_seqlens {end_list}")
    full = [n for n in end_list if n + new > capacity]
    if full:
        raise InvalidInputError(f"the cache holds {capacity} tokens per sequence: appending {new} to a sequence of "
                                f"{full[0]} does not fit")
    stray = sorted({p for p in host[2 * batch:] if p < 0 or p >= pages})
    if stray:
        raise InvalidInputError(f"block_table names pages outside the cache's {pages}: {stray[:8]}")
    return max((e + new - s for e, s in zip(end_list, start_list)), default=0)


def _lengths(name: str, value, batch: int, capacity: int, device) -> torch.Tensor:
    """``value`` as a (batch,) int32 tensor on ``device`` (an int, or an int32 tensor already)."""
    if value is None:
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if isinstance(value, torch.Tensor) and value.dtype == torch.int32 and value.shape == (batch,):
        if value.device != device:
            raise InvalidInputError(f"{name} is on {value.device} but q is on {device}")
        return value
    raise InvalidInputError(f"{name} must be an int or an int32 ({batch},) tensor, got "
                            f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}")


def _used_pages(block_table: torch.Tensor, ends: torch.Tensor, page_size: int) -> torch.Tensor:
    """The smallest and largest page the sequences use (positions below ``ends``; the rest of the table is
    never read), as two ints; (0, 0) when no sequence uses one."""
    used = torch.arange(block_table.shape[1], device=block_table.device) * page_size < ends.clamp(min=0)[:, None]
    if block_table.numel() == 0:
        return torch.zeros(2, dtype=torch.int32, device=block_table.device)
    low = torch.where(used, block_table, torch.iinfo(torch.int32).max).min()
    high = torch.where(used, block_table, torch.iinfo(torch.int32).min).max()
    none = ~used.any()
    return torch.stack((torch.where(none, 0, low), torch.where(none, 0, high))).to(torch.int32)


def _append(cache: torch.Tensor, new: torch.Tensor, at: torch.Tensor, block_table: torch.Tensor | None) -> None:
    """Write ``new`` (batch, n, heads, dim) into ``cache`` at positions ``at[b]`` ... ``at[b] + n - 1`` of each
    sequence, in place, on the device (no host loop). Positions and pages are clamped into the cache, so that
    unchecked values (check_inputs=False) never write outside it."""
    positions = at.long()[:, None] + torch.arange(new.shape[1], device=new.device)
    if block_table is None:
        positions = positions.clamp(0, cache.shape[1] - 1)
        cache[torch.arange(new.shape[0], device=new.device)[:, None], positions] = new
        return
    page_size = cache.shape[1]
    positions = positions.clamp(0, block_table.shape[1] * page_size - 1)
    page = block_table.long().gather(1, positions // page_size).clamp(0, cache.shape[0] - 1)
    cache[page, positions % page_size] = new

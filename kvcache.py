"""Attention against a KV cache, with FlashAttention's names and layouts: ``attention_with_kvcache``.

Contiguous caches (batch, max_seqlen, heads_kv, head_dim) or paged ones (num_blocks, page_size, heads_kv,
head_dim) with an int32 ``block_table`` (batch, max_pages); new keys and values are written into the cache in
place at ``cache_seqlens`` first, as flash-attn does. Each sequence then runs as its own ``attention()`` call
(bottom-right causal against its cache length), on a view of a contiguous cache or on its pages gathered. There
is no split-KV decode kernel yet: that is what makes decode fast, and this module is its interface.
"""

from __future__ import annotations

import torch

from .errors import InvalidInputError


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None, *, cache_seqlens: torch.Tensor | int | None = None,
                           block_table: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                           causal: bool = False, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           return_lse: bool = False, backend: str | None = None):
    """Attention of q (batch, seqlen_q, heads_q, head_dim) against each sequence's cached keys and values.

    ``cache_seqlens``: (batch,) int32 or an int: how many cached tokens each sequence has (default: the whole
    cache). ``k``, ``v`` (batch, seqlen_new, heads_kv, head_dim), if given, are written into the cache at those
    positions (in place) and attended too. ``cache_leftpad`` (batch,) int32: the first valid cache position per
    sequence. ``block_table`` (batch, max_pages) int32 makes the caches paged (page ``block_table[b, i]`` holds
    positions ``i * page_size ...``). ``causal`` aligns bottom-right: query i sits at position
    ``len + i - seqlen_q`` of the ``len`` keys it attends. Returns the output (batch, seqlen_q, heads_q,
    head_dim_v), and with ``return_lse`` the LSE (batch, heads_q, seqlen_q) fp32. Reads the lengths on the host
    (one sync); not under torch.compile yet.
    """
    from .api import attention
    from .op import lse_dtype

    if torch.compiler.is_compiling():
        raise InvalidInputError("attention_with_kvcache inside torch.compile is not supported yet (it reads the "
                                "cache lengths on the host); call it eagerly")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidInputError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if (k is None) != (v is None):
        raise InvalidInputError("pass k and v together, or neither")
    batch = q.shape[0]
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch:
            raise InvalidInputError(f"block_table must be an int32 (batch, max_pages) = ({batch}, ...) tensor, got "
                                    f"{getattr(block_table, 'dtype', None)} {tuple(getattr(block_table, 'shape', ()))}")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] < batch:
            raise InvalidInputError(f"k_cache has {k_cache.shape[0]} sequences for a batch of {batch}")
        capacity = k_cache.shape[1]
    lengths = _lengths("cache_seqlens", cache_seqlens, batch, capacity)
    starts = _lengths("cache_leftpad", cache_leftpad, batch, capacity) if cache_leftpad is not None else [0] * batch
    new = 0 if k is None else k.shape[1]
    if k is not None:
        if k.dim() != 4 or k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
            raise InvalidInputError(f"k and v must be (batch, seqlen_new, heads_kv, head_dim) with batch {batch}, got "
                                    f"{tuple(k.shape)} and {tuple(v.shape)}")
        full = [n for n in lengths if n + new > capacity]
        if full:
            raise InvalidInputError(f"the cache holds {capacity} tokens per sequence: appending {new} to a sequence "
                                    f"of {full[0]} does not fit")
    pages = block_table.tolist() if paged else None
    outs, lses = [], []
    for b in range(batch):
        end = lengths[b] + new
        if k is not None:
            _write(k_cache, k[b], lengths[b], b, pages)
            _write(v_cache, v[b], lengths[b], b, pages)
        keys, values = _read(k_cache, starts[b], end, b, pages), _read(v_cache, starts[b], end, b, pages)
        if keys.shape[0] == 0:  # nothing cached: every row sees no key
            outs.append(q.new_zeros((q.shape[1], q.shape[2], v_cache.shape[3])))
            lses.append(torch.full((q.shape[2], q.shape[1]), float("-inf"), device=q.device, dtype=lse_dtype(q)))
            continue
        out, lse = attention(q[b:b + 1], keys[None], values[None], causal=causal, scale=scale, layout="bshd",
                             window_size=window_size, return_lse=True, backend=backend)
        outs.append(out[0])
        lses.append(lse[0])
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out, lse) if return_lse else out


def _lengths(name: str, value, batch: int, capacity: int) -> list[int]:
    if value is None:
        return [capacity] * batch
    if isinstance(value, int) and not isinstance(value, bool):
        values = [value] * batch
    elif isinstance(value, torch.Tensor) and value.dtype == torch.int32 and value.shape == (batch,):
        values = value.tolist()
    else:
        raise InvalidInputError(f"{name} must be an int or an int32 ({batch},) tensor, got "
                                f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}")
    if any(n < 0 or n > capacity for n in values):
        raise InvalidInputError(f"{name} must be between 0 and the cache's {capacity} tokens, got {values}")
    return values


def _positions(start: int, end: int, page_size: int, pages: list[int]):
    """(page, offset) runs covering cache positions [start, end) of one sequence."""
    position = start
    while position < end:
        page, offset = divmod(position, page_size)
        take = min(page_size - offset, end - position)
        yield pages[page], offset, take
        position += take


def _write(cache: torch.Tensor, new: torch.Tensor, at: int, b: int, pages) -> None:
    if pages is None:
        cache[b, at:at + new.shape[0]] = new
        return
    done = 0
    for page, offset, take in _positions(at, at + new.shape[0], cache.shape[1], pages[b]):
        cache[page, offset:offset + take] = new[done:done + take]
        done += take


def _read(cache: torch.Tensor, start: int, end: int, b: int, pages) -> torch.Tensor:
    """Positions [start, end) of sequence b: a view of a contiguous cache, the pages gathered (a copy) if paged."""
    if pages is None:
        return cache[b, start:end]
    parts = [cache[page, offset:offset + take] for page, offset, take in _positions(start, end, cache.shape[1], pages[b])]
    return torch.cat(parts) if parts else cache.new_zeros((0, *cache.shape[2:]))

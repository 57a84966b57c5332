"""flash-attn 2's function names and signatures, served by attnforge: code written against ``flash_attn`` runs
on attnforge's dispatcher by changing its import only::

    from attnforge.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Each function takes flash-attn 2.8's parameters, in its order and with its defaults, and returns what it returns:
the output, plus ``(softmax_lse, S_dmask)`` with ``return_attn_probs`` (``softmax_lse`` with
``return_softmax_lse`` for the KV cache). Layouts, bottom-right causal masks, windows, softcap, ALiBi, GQA and
``deterministic`` mean what they mean there; the calls are attnforge's ``attention()``, ``attention_varlen()``
and ``attention_with_kvcache()``, so every call leaves its Decision in ``attnforge.last_decision()``.

Where this differs from flash-attn, it says so instead of computing something else:
- ``S_dmask`` is always None: the N x N probabilities are never materialised (flash-attn documents them as for
  testing only, and possibly wrongly scaled). ``return_attn_probs=True`` is the way flash-attn callers get the
  LSE, and that comes back.
- Refused with the reason (InvalidInputError): dropout on a packed (varlen) batch, a paged varlen batch
  (``block_table`` on flash_attn_varlen_func), and on the KV cache rotary embeddings (``rotary_cos``,
  ``rotary_sin``: apply them to q and k before the call) and ALiBi.
- ``cache_batch_idx`` (sequence b reads and appends to cache row ``cache_batch_idx[b]``) is served by reading the
  contiguous cache as a paged one whose pages are whole rows: no copy of the cache.
- flash_attn_with_kvcache checks the lengths and rows on the host (one sync) and raises on a value outside the
  cache, except while a CUDA graph is being captured: then it reads nothing on the host, as flash-attn does, so a
  decode step can be captured, and a value outside the cache gives NaN rows (attention_with_kvcache's
  ``check_inputs=False``).
"""

from __future__ import annotations

import torch

from ..api import attention
from ..errors import InvalidInputError
from ..kvcache import attention_with_kvcache
from ..varlen import attention_varlen

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, heads_q, head_dim), k, v: (batch, seqlen_k, heads_kv, head_dim). Returns the output
    (batch, seqlen_q, heads_q, head_dim), and with ``return_attn_probs`` also the LSE (batch, heads_q, seqlen_q)
    fp32 and None (see the module's docstring)."""
    result = attention(q, k, v, causal=causal, scale=softmax_scale, dropout_p=dropout_p, layout="bshd",
                       return_lse=bool(return_attn_probs), window_size=_window(window_size), softcap=softcap,
                       alibi_slopes=alibi_slopes, deterministic=deterministic)
    return (*result, None) if return_attn_probs else result


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of ``qkv`` (batch, seqlen, 3, heads, head_dim): q, k and v stacked on dim 2."""
    q, k, v = _unpack(qkv, "qkv", 3, dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func of q and ``kv`` (batch, seqlen_k, 2, heads_kv, head_dim): k and v stacked on dim 2."""
    k, v = _unpack(kv, "kv", 2, dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """A packed batch: q (total_q, heads_q, head_dim), k, v (total_k, heads_kv, head_dim), int32 offsets
    ``cu_seqlens_*`` (batch + 1,). Returns the output (total_q, heads_q, head_dim), and with
    ``return_attn_probs`` also the LSE (heads_q, total_q) fp32 and None."""
    if dropout_p:
        raise InvalidInputError(f"dropout on a packed (varlen) batch is not supported (dropout_p={dropout_p!r}); "
                                "pass dropout_p=0.0")
    if block_table is not None:
        raise InvalidInputError("a paged packed batch (block_table) is not supported here: attend to a paged "
                                "cache with flash_attn_with_kvcache")
    result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                              scale=softmax_scale, window_size=_window(window_size), softcap=softcap,
                              alibi_slopes=alibi_slopes, return_lse=bool(return_attn_probs),
                              deterministic=deterministic)
    return (*result, None) if return_attn_probs else result


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func of ``qkv`` (total, 3, heads, head_dim), one set of offsets for q and k."""
    q, k, v = _unpack(qkv, "qkv", 3, dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func of q and ``kv`` (total_k, 2, heads_kv, head_dim)."""
    k, v = _unpack(kv, "kv", 2, dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention against a KV cache, appending ``k``, ``v`` in place first (attnforge.attention_with_kvcache).
    ``cache_batch_idx`` (batch,) int32: the cache row of each sequence (default: row b for sequence b). Returns
    the output (batch, seqlen_q, heads_q, head_dim), and with ``return_softmax_lse`` the LSE (batch, heads_q,
    seqlen_q) fp32."""
    if rotary_cos is not None or rotary_sin is not None:
        raise InvalidInputError("rotary embeddings in the KV-cache call (rotary_cos, rotary_sin) are not applied "
                                "here: rotate q and k before the call")
    if alibi_slopes is not None:
        raise InvalidInputError("ALiBi against a KV cache is not supported (alibi_slopes)")
    checked = not _capturing(q)
    if cache_batch_idx is not None:
        # a contiguous (batch_cache, seqlen_cache, heads_kv, head_dim) cache is a paged one of batch_cache pages
        # of seqlen_cache rows: sequence b's one page is row cache_batch_idx[b]
        block_table = _rows_as_pages(cache_batch_idx, q, block_table, k_cache, checked)
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                                  cache_leftpad=cache_leftpad, causal=causal, scale=softmax_scale,
                                  window_size=_window(window_size), softcap=softcap, num_splits=num_splits,
                                  return_lse=bool(return_softmax_lse), check_inputs=checked)


def _capturing(q) -> bool:
    """Whether a CUDA graph is being captured on q's device (where no host read may happen)."""
    return (isinstance(q, torch.Tensor) and q.device.type == "cuda" and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing())


def _window(window_size):
    """flash-attn takes the window as a tuple or a list; attention() checks it as a tuple."""
    return tuple(window_size) if isinstance(window_size, list) else window_size


def _unpack(packed, name: str, parts: int, dim: int) -> tuple:
    """The views of ``packed`` along ``dim`` (which holds ``parts``), checked first."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != dim + 3 or packed.shape[dim] != parts:
        layout = ("(batch, seqlen, " if dim == 2 else "(total, ") + f"{parts}, heads, head_dim)"
        raise InvalidInputError(f"{name} must be a {layout} tensor, got {getattr(packed, 'shape', type(packed))}")
    return packed.unbind(dim)


def _rows_as_pages(cache_batch_idx, q, block_table, k_cache, checked: bool) -> torch.Tensor:
    """cache_batch_idx as the block table of a paged cache whose pages are the contiguous cache's rows (with
    ``checked``, each row read on the host and checked to be one of the cache's)."""
    if block_table is not None:
        raise InvalidInputError("cache_batch_idx indexes a contiguous cache: it cannot be combined with block_table")
    if (not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32
            or cache_batch_idx.shape != (q.shape[0],)):
        raise InvalidInputError(f"cache_batch_idx must be an int32 (batch,) = ({q.shape[0]},) tensor, got "
                                f"{getattr(cache_batch_idx, 'dtype', type(cache_batch_idx))} "
                                f"{tuple(getattr(cache_batch_idx, 'shape', ()))}")
    if checked and isinstance(k_cache, torch.Tensor) and not torch.compiler.is_compiling():
        rows = k_cache.shape[0]
        outside = sorted({row for row in cache_batch_idx.tolist() if not 0 <= row < rows})
        if outside:
            raise InvalidInputError(f"cache_batch_idx names rows outside the cache's {rows}: {outside}")
    return cache_batch_idx.unsqueeze(1)

"""One attention call as backends run it: the tensors, in (batch, heads, seqlen, head_dim) order, and
everything else that changes the result but not which kernel runs it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .mask import Mask


class KVCache(NamedTuple):
    """Where each sequence's keys sit in a KV cache (attention_with_kvcache): cache positions [``leftpad[b]``,
    ``seqlens[b]``) of its row, or of the pages ``block_table[b]`` names. ``seqlens``, ``leftpad`` (B,) int32,
    ``leftpad`` None for 0; ``block_table`` (B, max_pages) int32 or None (contiguous); ``longest`` the largest key
    count (a host int; the capacity when the lengths were not read); ``num_splits`` the key splits asked for (0: the
    backend's heuristic); ``descale`` (2, B, heads_kv) fp32 for an fp8 cache: its keys and values are
    cache * descale[0 or 1, b, kv head]."""

    seqlens: torch.Tensor
    leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    longest: int
    num_splits: int = 0
    descale: torch.Tensor | None = None


class Varlen(NamedTuple):
    """A packed batch (attention_varlen): sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (the
    packed dim) against rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v; int32 (batch + 1,) offsets on the
    tensors' device, validated; ``max_seqlen_*`` host ints at least the longest sequence."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    host: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the offsets as host ints, where already read

    def bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The offsets (q's, k's) as host ints: the copy the caller read, else read now (a device sync)."""
        if self.host is not None:
            return self.host
        return tuple(self.cu_seqlens_q.tolist()), tuple(self.cu_seqlens_k.tolist())


class Call(NamedTuple):
    """q, k, v (batch, heads, seqlen, head_dim) with any strides; ``scale`` the softmax scale (a float);
    ``mask`` the Problem's Mask; ``descale`` (3, batch, heads_kv) fp32 for FP8 inputs; ``attn_mask`` an
    explicit mask tensor (``attnforge.sdpa``, ``mask.tensor``); ``softcap`` the score cap (0: none; scores become
    softcap * tanh(scores / softcap) after scaling); ``sinks`` (heads_q,) fp32 logits that count in each row's
    softmax denominator and carry no value, or None; ``cache`` a KVCache when k and v are cache views
    ((batch or page, heads_kv, positions, head_dim)); ``varlen`` a Varlen when q, k, v are (1, heads, total, head_dim)
    views of a packed batch. A NamedTuple: made on every call, cheaply."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    mask: Mask
    dropout_p: float = 0.0
    descale: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None  # (batch, heads_q) fp32, heads contiguous (problem.alibi_slopes_of)
    cache: KVCache | None = None
    varlen: Varlen | None = None

    @property
    def causal(self) -> bool:
        return self.mask.causal

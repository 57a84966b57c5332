"""One attention call as backends run it: the tensors, in (batch, heads, seqlen, head_dim) order, and
everything else that changes the result but not which kernel runs it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .mask import Mask


class Call(NamedTuple):
    """q, k, v (batch, heads, seqlen, head_dim) with any strides; ``scale`` the softmax scale (a float);
    ``mask`` the Problem's Mask; ``descale`` (3, batch, heads_kv) fp32 for FP8 inputs; ``attn_mask`` an
    explicit mask tensor (``attnforge.sdpa``, ``mask.tensor``); ``softcap`` the score cap (0: none; scores become
    softcap * tanh(scores / softcap) after scaling); ``sinks`` (heads_q,) fp32 logits that count in each row's
    softmax denominator and carry no value, or None. A NamedTuple: made on every call, cheaply."""

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

    @property
    def causal(self) -> bool:
        return self.mask.causal

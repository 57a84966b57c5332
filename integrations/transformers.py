"""Hugging Face transformers: `register()` makes `attn_implementation="attnforge"` work.

Mirrors transformers' own SDPA integration: with no attention mask (the usual causal prefill) the
call goes to attnforge.attention with causal=True, so the fast kernels serve it; a mask (padding,
sliding windows, ...) goes through attnforge.sdpa, which keeps SDPA's mask semantics and serves
them with the `sdpa` backend. Needs the `transformers` extra.
"""

from __future__ import annotations

import torch

from .. import api

NAME = "attnforge"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attnforge does not support softcap; use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout = dropout if module.training else 0.0
    if attention_mask is None:
        # One query (decoding) sees every cached key; a prefill is square, where bottom-right and
        # top-left causal agree.
        out = api.attention(query, key, value, causal=bool(is_causal) and query.shape[2] > 1, scale=scaling,
                            dropout_p=dropout)
    else:
        mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask.dim() == 4 else attention_mask
        out = api.sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register attnforge with transformers' attention (and mask) interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes, None when it can be is_causal
    return NAME

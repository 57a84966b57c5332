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
    """transformers' attention-function interface: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out.
    ``softcap`` (Gemma 2's attn_logit_softcapping) and ``s_aux`` (gpt-oss's sinks) go to attention(); with a mask
    tensor they are refused (the mask path is SDPA's, which has neither)."""
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks, one logit per query head
    if (softcap or sinks is not None) and attention_mask is not None:
        raise ValueError("attnforge serves softcap and sinks only without an attention mask tensor (no padding, no "
                         "sliding window mask); use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout = dropout if module.training else 0.0
    if attention_mask is None:
        # One query (decoding) sees every cached key; a prefill is square, where bottom-right and
        # top-left causal agree.
        out = api.attention(query, key, value, causal=bool(is_causal and query.shape[2] > 1), scale=scaling,
                            dropout_p=dropout, softcap=softcap, sinks=sinks)
    else:
        mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask.dim() == 4 else attention_mask
        out = api.sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register attnforge with transformers' attention (and mask) interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, causal_mask)  # the masks SDPA takes, None when it can be is_causal
    return NAME


def causal_mask(*args, **kwargs):
    """transformers' SDPA mask, except that a plain causal mask with no padding mask is None (then
    attention_forward runs the fast causal kernels) under torch.compile too: transformers materialises it
    while tracing, because telling whether a padding mask hides nothing reads its values; with no padding
    mask at all that is known without reading anything."""
    from transformers.masking_utils import sdpa_mask

    if _plain_causal(sdpa_mask, args, kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _plain_causal(sdpa_mask, args, kwargs) -> bool:
    """Whether the mask transformers asks for is causal over the whole square (or a single query seeing
    every key), with no padding mask and no window. Unknown arguments (another transformers version)
    mean no: transformers' own mask is made."""
    import inspect

    from transformers.masking_utils import causal_mask_function

    try:
        bound = inspect.signature(sdpa_mask).bind(*args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    a = bound.arguments
    if "q_length" in a:
        q_length = a["q_length"]
    elif isinstance(a.get("cache_position"), torch.Tensor):
        q_length = a["cache_position"].shape[0]
    else:
        return False
    if a.get("attention_mask", True) is not None or a.get("local_size") is not None:
        return False
    if not a.get("allow_is_causal_skip", False) or a.get("mask_function") is not causal_mask_function:
        return False
    return q_length == 1 or (q_length == a.get("kv_length") and a.get("kv_offset", 0) == 0)

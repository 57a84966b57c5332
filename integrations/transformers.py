"""Hugging Face transformers: `register()` makes `attn_implementation="attnforge"` work.

Mirrors transformers' own SDPA integration: with no attention mask (the usual causal prefill) the
call goes to attnforge.attention with causal=True, so the fast kernels serve it; a sliding-window layer
(Mistral, Gemma 2, gpt-oss) with no padding goes there too, with the window as window_size; a mask
(padding, chunked attention, ...) goes through attnforge.sdpa, which keeps SDPA's mask semantics and
serves them with the `sdpa` backend. A padding-free packed batch (one row of concatenated sequences with
FlashAttention's varlen kwargs, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them) goes to
attnforge.attention_varlen. Needs the `transformers` extra.
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
    tensor they are refused (the mask path is SDPA's, which has neither). ``sliding_window`` (the layer's window,
    None for a full-attention layer) becomes window_size: transformers' rule lets query i see key j iff
    i - sliding_window < j <= i, that is a left window of sliding_window - 1 (causal_mask gives no tensor then)."""
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks, one logit per query head
    packed = _packed(query, kwargs)
    if packed is not None:
        return _packed_forward(module, query, key, value, packed, dropout, scaling, is_causal, softcap, sinks,
                               kwargs.get("sliding_window")), None
    if (softcap or sinks is not None) and attention_mask is not None:
        raise ValueError("attnforge serves softcap and sinks only without an attention mask tensor (no padding, no "
                         "sliding window mask); use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout = dropout if module.training else 0.0
    if attention_mask is None:
        # One query (decoding) sees every cached key (within the window); a prefill is square, where bottom-right
        # and top-left causal agree.
        window = kwargs.get("sliding_window")
        causal = bool(is_causal and query.shape[2] > 1)
        window_size = (-1, -1) if not window else (int(window) - 1, 0 if causal else -1)
        out = api.attention(query, key, value, causal=causal, scale=scaling, dropout_p=dropout, softcap=softcap,
                            sinks=sinks, window_size=window_size)
    else:
        mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask.dim() == 4 else attention_mask
        out = api.sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _packed(query: torch.Tensor, kwargs: dict):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a padding-free packed batch, where transformers
    passes FlashAttention's varlen kwargs (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``:
    DataCollatorWithFlattening(return_flash_attn_kwargs=True)) for one row of concatenated sequences; else None."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if query.shape[0] != 1 or any(kwargs.get(n) is None for n in names):
        return None
    cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


def _packed_forward(module, query, key, value, packed, dropout, scaling, is_causal, softcap, sinks, window):
    """A packed row through attention_varlen, as transformers' FlashAttention path runs it: causal within each
    sequence (the block-diagonal mask transformers builds from the packed position ids says the same, so it is not
    read), the layer's window and softcap. (batch 1, heads, total, dim) in, (1, total, heads, dim) out."""
    from ..varlen import attention_varlen

    if module.training and dropout:
        raise ValueError("attnforge has no attention dropout for packed (varlen) batches; set attention_dropout=0 "
                         "or use attn_implementation='sdpa'")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window_size = (-1, -1) if not window else (int(window) - 1, 0 if causal else -1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (total, heads, dim)
    out = attention_varlen(q, k, v, *packed, causal=causal, scale=scaling, window_size=window_size, softcap=softcap,
                           sinks=sinks)
    return out.unsqueeze(0)


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
    every key), with no padding mask, and no window or transformers' sliding window (attention_forward
    applies the layer's window). Unknown arguments (another transformers version) mean no: transformers'
    own mask is made."""
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
    if a.get("attention_mask", True) is not None or not a.get("allow_is_causal_skip", False):
        return False
    window = a.get("local_size")
    if window is None:
        if a.get("mask_function") is not causal_mask_function:
            return False
    elif not _is_sliding_causal(a.get("mask_function"), window):
        return False
    return q_length == 1 or (q_length == a.get("kv_length") and a.get("kv_offset", 0) == 0)


def _is_sliding_causal(mask_function, window) -> bool:
    """Whether ``mask_function`` is transformers' sliding-window causal mask of ``window`` (key j visible to query i
    iff i - window < j <= i) rather than the chunked one that also passes local_size (Llama 4): told apart at the
    points where they differ. transformers turns the causal skip off for any other pattern it combines."""
    if not isinstance(window, int) or window < 1 or not callable(mask_function):
        return False
    try:
        probes = {(window, 1): True, (window, 0): False, (0, 1): False, (window - 1, 0): True}
        zero = torch.tensor(0)
        return all(bool(mask_function(zero, zero, torch.tensor(q), torch.tensor(kv))) == want
                   for (q, kv), want in probes.items())
    except Exception:  # noqa: BLE001 - a mask function that takes no scalar index tensors: not the one recognised
        return False


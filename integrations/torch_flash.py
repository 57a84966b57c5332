"""attnforge as torch's flash-attention implementation (torch 2.9+: ``torch.nn.attention``'s registry).

``import attnforge`` registers the name "attnforge"; it never activates it (torch's registry asks providers
not to). After ``torch.nn.attention.activate_flash_attention_impl("attnforge")``, every call torch sends to its
FLASH backend on CUDA devices runs attnforge's dispatcher and kernels: ``F.scaled_dot_product_attention``
where torch picks flash, its ``context_parallel`` ring steps, and direct calls of the aten flash ops. Each
call leaves its Decision in ``attnforge.last_decision()`` / ``decisions()``. Other devices keep torch's kernels.

Semantics, as the aten ops define them:
- ``aten::_scaled_dot_product_flash_attention`` (and its backward) is SDPA's op: (batch, heads, seqlen, dim)
  tensors, ``is_causal`` aligned top-left (query i sees keys j <= i); with seqlen_q == seqlen_k both
  alignments agree, and the fast kernels serve it.
- ``aten::_flash_attention_forward`` / ``_backward`` (and ``_flash_attention_forward_no_dropout_inplace``)
  are FlashAttention's: (batch, seqlen, heads, dim) tensors, ``is_causal`` aligned bottom-right.
- The LSE is natural-log, fp32, (batch, heads, seqlen_q); the philox seed and offset are zeros (there is no
  dropout); the outputs and gradients have the strides torch's meta functions give (``empty_like`` of the
  inputs).
- Variable-length batches (``cum_seq_q``, ``cum_seq_k``: torch's jagged nested tensors) are
  ``_flash_attention_forward``'s (total, heads, dim) tensors with int32 offsets; they run as attention_varlen's
  packed batch, with its (heads, total_q) LSE, as torch's meta function gives it.
- What attnforge does not serve yet is refused with the reason (torch's own flash kernel is replaced, so
  there is nothing to fall back to): dropout, the debug mask, ``seqused_k``, a paged ``block_table``, ALiBi and
  sliding windows. ``num_splits`` is a speed hint; the dispatcher's own choice stands.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..dispatch import registry
from ..dispatch.call import Call
from ..dispatch.mask import CAUSAL, NONE, Mask
from ..dispatch.select import decide_call
from ..errors import BackendUnavailableError

NAME = "attnforge"
_TOP_LEFT_CAUSAL = Mask(causal=True, top_left=True)


def register() -> bool:
    """Register "attnforge" with torch's flash-attention registry (not activating it); False where this torch
    has no registry (before 2.9)."""
    try:
        from torch.nn.attention import register_flash_attention_impl
    except ImportError:
        return False
    register_flash_attention_impl(NAME, register_fn=_install)
    return True


@dataclasses.dataclass
class _Handle:
    """What activate_flash_attention_impl keeps: remove() gives torch its own flash kernels back."""

    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _install() -> _Handle:
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    lib.impl("_scaled_dot_product_flash_attention", sdpa_flash_forward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention_backward", sdpa_flash_backward, "CUDA")
    lib.impl("_flash_attention_forward", flash_forward, "CUDA")
    lib.impl("_flash_attention_backward", flash_backward, "CUDA")
    lib.impl("_flash_attention_forward_no_dropout_inplace", flash_forward_no_dropout_inplace, "CUDA")
    return _Handle(lib)


def _refuse(op: str, **unsupported) -> None:
    named = [f"{name}={value!r}" for name, value in unsupported.items() if value]
    if named:
        raise BackendUnavailableError(f"attnforge, active as torch's flash-attention implementation, does not serve "
                                      f"{op} with {', '.join(named)} yet; restore torch's own kernels with "
                                      "torch.nn.attention.restore_flash_attention_impl()")


def _check_window(op: str, left, right) -> None:
    windowed = any(w is not None and w != -1 for w in (left, right))
    _refuse(op, sliding_window=(left, right) if windowed else None)


def _sdpa_mask(is_causal: bool, query: torch.Tensor, key: torch.Tensor) -> Mask:
    if not is_causal:
        return NONE
    return CAUSAL if query.shape[2] == key.shape[2] else _TOP_LEFT_CAUSAL


def _scale(scale, query: torch.Tensor) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _bhsd(layout: str, *tensors):
    return tensors if layout == "bhsd" else tuple(t.transpose(1, 2) for t in tensors)


def _like(result: torch.Tensor, layout: str, like: torch.Tensor) -> torch.Tensor:
    """``result`` (batch, heads, seqlen, dim) as torch's meta function has the op return it: empty_like(like)."""
    result = _bhsd(layout, result)[0]
    return result if result.stride() == like.stride() else torch.empty_like(like).copy_(result)


def _forward(op, query, key, value, layout, mask, scale):
    """(out in ``query``'s layout and strides, fp32 LSE (batch, heads, seqlen_q)), by the Decision attention()
    takes for this call with return_lse."""
    decision = _decision(op, query, key, value, layout, mask, None)
    q, k, v = _bhsd(layout, query, key, value)
    out, lse = registry.get(decision.forward.backend).forward(decision.forward.variant,
                                                              Call(q, k, v, _scale(scale, query), mask))
    return _like(out, layout, query), lse.float().contiguous()


def _backward(op, grad_out, query, key, value, out, logsumexp, layout, mask, scale):
    """(dq, dk, dv) with the inputs' strides, by the backward of the Decision attention() takes with grad."""
    choice = _decision(op, query, key, value, layout, mask, True).backward
    q, k, v, o, dout = _bhsd(layout, query, key, value, out, grad_out)
    grads = registry.get(choice.backend).backward(choice.variant, Call(q, k, v, _scale(scale, query), mask), o,
                                                  logsumexp, dout.contiguous())
    return tuple(_like(g, layout, t) for g, t in zip(grads, (query, key, value)))


def _decision(op, query, key, value, layout, mask, needs_grad):
    try:
        return decide_call(query, key, value, layout, mask, 0.0, True, None, needs_grad=needs_grad)
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"attnforge, active as torch's flash-attention implementation, cannot serve "
                                      f"{op}:\n{e}") from None


def _seeds(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The philox seed and offset of a call without dropout: zeros, in the dtypes torch's meta functions give."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention: (batch, heads, seqlen, dim), top-left ``is_causal``."""
    op = "aten::_scaled_dot_product_flash_attention"
    _refuse(op, dropout_p=dropout_p, return_debug_mask=return_debug_mask)
    out, lse = _forward(op, query, key, value, "bhsd", _sdpa_mask(is_causal, query, key), scale)
    seed, offset = _seeds(query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: (dq, dk, dv)."""
    op = "aten::_scaled_dot_product_flash_attention_backward"
    _refuse(op, dropout_p=dropout_p, cum_seq_q=cum_seq_q is not None and cum_seq_q.numel() > 0)
    return _backward(op, grad_out, query, key, value, out, logsumexp, "bhsd", _sdpa_mask(is_causal, query, key),
                     scale)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                  scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):
    """aten::_flash_attention_forward: (batch, seqlen, heads, dim), bottom-right ``is_causal``."""
    op = "aten::_flash_attention_forward"
    _refuse(op, dropout_p=dropout_p, return_debug_mask=return_debug_mask, seqused_k=seqused_k is not None,
            alibi_slopes=alibi_slopes is not None, block_table=block_table is not None,
            cum_seq_k=(cum_seq_q is None) != (cum_seq_k is None))
    _check_window(op, window_size_left, window_size_right)
    if cum_seq_q is not None:
        out, lse = _packed(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale)
        seed, offset = _seeds(query.device)
        return out, lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)
    out, lse = _forward(op, query, key, value, "bshd", CAUSAL if is_causal else NONE, scale)
    seed, offset = _seeds(query.device)
    return out, lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)


def flash_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                     return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                     seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward_no_dropout_inplace: the output written into ``out``; returns the LSE."""
    result, lse, *_ = flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                    return_debug_mask, scale=scale, window_size_left=window_size_left,
                                    window_size_right=window_size_right, seqused_k=seqused_k,
                                    alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits)
    out.copy_(result)
    return lse


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """aten::_flash_attention_backward: (dq, dk, dv) for (batch, seqlen, heads, dim) inputs."""
    op = "aten::_flash_attention_backward"
    _refuse(op, dropout_p=dropout_p)
    _check_window(op, window_size_left, window_size_right)
    if cum_seq_q is not None and cum_seq_q.numel() > 0:
        return _packed_backward(op, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                is_causal, scale)
    return _backward(op, grad_out, query, key, value, out, logsumexp, "bshd", CAUSAL if is_causal else NONE, scale)


def _packed(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale):
    """A packed batch ((total, heads, dim), int32 offsets) by attention_varlen's Decision: (out with ``query``'s
    strides, fp32 LSE (heads, total_q))."""
    from ..op import attention_varlen_op

    try:
        out, lse = attention_varlen_op(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), is_causal,
                                       -1, -1, _scale(scale, query), 0.0, None, None, False, True, False, None)
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"attnforge, active as torch's flash-attention implementation, cannot serve "
                                      f"{op}:\n{e}") from None
    like = torch.empty_like(query)
    return (out if out.stride() == like.stride() else like.copy_(out)), lse.float()


def _packed_backward(op, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                     scale):
    """(dq, dk, dv) of a packed batch, with the inputs' strides, by attention_varlen's backward Decision."""
    from ..op import attention_varlen_backward_op

    try:
        grads = attention_varlen_backward_op(grad_out.contiguous(), query, key, value, cum_seq_q, cum_seq_k,
                                             int(max_q), int(max_k), out, logsumexp, None, is_causal, -1, -1,
                                             _scale(scale, query), 0.0, None, None, True, False, None)
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"attnforge, active as torch's flash-attention implementation, cannot serve "
                                      f"{op}:\n{e}") from None
    return tuple(g if g.stride() == torch.empty_like(t).stride() else torch.empty_like(t).copy_(g)
                 for g, t in zip(grads, (query, key, value)))

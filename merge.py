"""Merging partial attention results computed over disjoint key sets (ring attention, context
parallelism, cascade inference): FlashInfer's and xformers' ``merge_states``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InvalidInputError

_LSE_DTYPES = (torch.float32, torch.float64)


def merge_states(outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor):
    """Exact attention over the union of disjoint key sets, from each set's output and natural-log LSE.

    ``outs``: a sequence of (batch, heads, seqlen_q, head_dim) outputs (any float dtype, all the same),
    or one tensor with the chunk dim first; ``lses``: the matching (batch, heads, seqlen_q) LSEs (fp32
    or fp64), as attention(..., return_lse=True) gives them. Any leading dims work as long as each LSE's
    shape is its output's without the last dim. Returns ``(out, lse)`` with lse = logsumexp_i(lse_i)
    and out = sum_i exp(lse_i - lse) * out_i, computed in fp32 (fp64 when an input is fp64): out in the
    outputs' dtype, lse in fp32 (fp64 then). A chunk that saw no key (lse -inf) adds nothing; a row
    where every chunk saw none gives out 0 and lse -inf. A NaN in any chunk's row makes that row NaN.
    Plain torch ops: differentiable through out and lse, and NaN-free gradients on -inf rows.
    """
    outs, lses = _stacked(outs, "outs"), _stacked(lses, "lses")
    _check(outs, lses)
    acc = torch.float64 if torch.float64 in (outs.dtype, lses.dtype) else torch.float32
    lses = lses.to(acc)
    # the max is only a shift for exp's range; it cancels exactly, so it carries no gradient
    shift = lses.detach().amax(0)
    shift = shift.masked_fill(shift == float("-inf"), 0.0)  # all-empty rows: exp(-inf - 0) = 0, not NaN
    weights = torch.exp(lses - shift)  # (chunks, ...): 0 for chunks that saw no key
    total = weights.sum(0)
    empty = total == 0  # every chunk saw no key (NaN compares unequal: NaN rows stay NaN)
    total = total.masked_fill(empty, 1.0)  # keeps log and division (and their gradients) finite there
    lse = torch.where(empty, float("-inf"), shift + torch.log(total))
    out = ((weights / total).unsqueeze(-1) * outs.to(acc)).sum(0)
    return out.to(outs.dtype), lse


def _stacked(x, name: str) -> torch.Tensor:
    """One tensor with the chunk dim first, from a tensor or a non-empty sequence of same-shaped tensors."""
    if isinstance(x, torch.Tensor):
        if x.dim() < 1 or x.shape[0] == 0:
            raise InvalidInputError(f"merge_states: {name} has no chunk (stacked tensor of shape {tuple(x.shape)})")
        return x
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise InvalidInputError(f"merge_states: {name} must be a sequence of tensors or one stacked tensor, "
                                f"got {type(x).__name__}")
    if len(x) == 0:
        raise InvalidInputError(f"merge_states: {name} is empty; give at least one chunk")
    for i, t in enumerate(x):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"merge_states: {name}[{i}] is {type(t).__name__}, not a tensor")
        first = x[0]
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise InvalidInputError(f"merge_states: {name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} but "
                                    f"{name}[0] is {tuple(first.shape)} {first.dtype} on {first.device}")
    return torch.stack(tuple(x))


def _check(outs: torch.Tensor, lses: torch.Tensor) -> None:
    if outs.dim() < 2:
        raise InvalidInputError(f"merge_states: each output needs at least a head_dim, got outs of shape "
                                f"{tuple(outs.shape)} (chunks first)")
    if outs.shape[:-1] != lses.shape:
        raise InvalidInputError(f"merge_states: outs {tuple(outs.shape)} and lses {tuple(lses.shape)} do not match "
                                "(chunks first; each lse is its output's shape without head_dim)")
    if outs.device != lses.device:
        raise InvalidInputError(f"merge_states: outs are on {outs.device} but lses on {lses.device}")
    if not outs.is_floating_point():
        raise InvalidInputError(f"merge_states: outs must be floating point, got {outs.dtype}")
    if lses.dtype not in _LSE_DTYPES:
        raise InvalidInputError(f"merge_states: lses must be float32 (or float64), got {lses.dtype}")

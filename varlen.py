"""Variable-length (packed) batches with FlashAttention's names and layouts: ``attention_varlen``.

Sequences are packed along the first dim, (total_tokens, heads, head_dim), and delimited by int32
``cu_seqlens`` (batch + 1 offsets from 0), as ``flash_attn_varlen_func`` takes them. The call is one dispatched
Problem (``varlen``; batch counts the sequences, seqlen_q/seqlen_k are the longest's): triton_fa2 and triton_rocm
run it in one launch of their VARLEN kernels (forward and backward), each CTA finding its sequence's rows
through the offsets, so no padding is computed and no CTA runs past its sequence; sdpa and reference, where they
serve, run one sequence at a time on views of the packed tensors. The Decision says which ran and why the others
could not.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref

import torch

from .dispatch.call import Call, Varlen
from .dispatch.problem import (Problem, check_deterministic, check_scale, check_sinks, check_softcap,
                               problem_from_tensors, torch_deterministic)
from .dispatch.registry import get
from .dispatch.select import decide_keyed, forced_backend
from .errors import InvalidInputError
from .op import lse_dtype


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                     return_lse: bool = False, deterministic: bool = False, backend: str | None = None):
    """Attention over a packed batch: sequence i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q against rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of k and v, with attention()'s semantics (``causal`` bottom-right per
    sequence, ``window_size``, ``softcap``, ``sinks``, ``scale`` default 1/sqrt(head_dim), GQA, ``deterministic``).

    q: (total_q, heads_q, head_dim), k: (total_k, heads_kv, head_dim), v: (total_k, heads_kv, head_dim_v);
    cu_seqlens_*: int32 (batch + 1,) offsets from 0 to total, non-decreasing (zero-length sequences allowed);
    ``max_seqlen_*``: at least the longest sequence (checked). ``alibi_slopes``: (heads_q,) or (batch, heads_q)
    floats, a row per sequence (FlashAttention's). Returns the output (total_q, heads_q, head_dim_v) and with
    ``return_lse`` the natural-log LSE (heads_q, total_q) in fp32, -inf for rows that see no key. Differentiable
    (the LSE and sinks too). Reads the offsets on the host (one device sync; none when these offsets tensors were
    read before and have not changed since, as when a model's layers share them; offsets made under
    torch.inference_mode() are read on every call). Under torch.compile it is one opaque
    custom op (op.attention_varlen_op), which reads and checks them when the graph runs.
    """
    from .api import _Attention, _causal_mask, autocast_inputs

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise InvalidInputError(f"{name} must be a (total_tokens, heads, head_dim) tensor, got "
                                    f"{getattr(t, 'shape', type(t).__name__)}")
    q, k, v = autocast_inputs(q, k, v)  # (as attention(): inside torch.autocast, the dtype that runs)
    mask = _causal_mask(causal, window_size)
    softcap = check_softcap(softcap)
    deterministic = check_deterministic(deterministic)
    if sinks is not None:
        check_sinks(sinks, q.unsqueeze(0), "bshd")
    if torch.compiler.is_compiling():
        return _traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, softcap, sinks,
                       alibi_slopes, return_lse, deterministic, backend)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    decision, call = decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, softcap,
                            sinks, alibi_slopes, return_lse, needs_grad, deterministic, backend)
    fwd = get(decision.forward.backend)
    if fwd.autograd_native or not needs_grad:
        out, lse = fwd.forward(decision.forward.variant, call)
    else:
        out, lse = _Attention.apply(call.q, call.k, call.v, None, sinks, decision, call)
    out = out[0].transpose(0, 1)  # (total_q, heads, dim_v)
    if not return_lse:
        return out
    return out, lse[0].to(lse_dtype(q))


def decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, softcap: float, sinks,
           alibi_slopes, return_lse: bool, needs_grad: bool, deterministic: bool, backend):
    """The Decision for a packed batch (recorded, so last_decision() reports it) and the Call that runs it, after
    checking the tensors and reading the offsets on the host. The Call's q, k, v are (1, heads, total, dim) views
    and its alibi_slopes a row per sequence."""
    if k.shape[0] != v.shape[0]:
        raise InvalidInputError(f"k has {k.shape[0]} tokens and v {v.shape[0]}: they must be packed alike")
    bounds_q, bounds_k = _offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], q.device)
    if len(bounds_q) != len(bounds_k):
        raise InvalidInputError(f"cu_seqlens_q has {len(bounds_q) - 1} sequences and cu_seqlens_k "
                                f"{len(bounds_k) - 1}: they must have the same batch")
    longest_q = _check_max("max_seqlen_q", max_seqlen_q, bounds_q)
    longest_k = _check_max("max_seqlen_k", max_seqlen_k, bounds_k)
    sequences = len(bounds_q) - 1
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, total, heads, dim): one packed "batch"
    if alibi_slopes is not None:
        alibi_slopes = _slopes(alibi_slopes, sequences, q)
    forced = forced_backend(backend)
    by_torch = torch_deterministic(needs_grad)
    key = ("varlen", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, sequences,
           longest_q, longest_k, mask, softcap, sinks is not None, alibi_slopes is not None, bool(return_lse),
           needs_grad, deterministic, by_torch, forced)

    def problem() -> Problem:
        dense = problem_from_tensors(q4, k4, v4, layout="bshd", mask=mask, return_lse=bool(return_lse),
                                     needs_grad=needs_grad, softcap=softcap, sinks=sinks is not None,
                                     alibi=alibi_slopes is not None, deterministic=deterministic,
                                     torch_deterministic=by_torch)
        # (the packed layout's one "batch" of total tokens, as the sequences and longest lengths it holds)
        return dataclasses.replace(dense, batch=sequences, seqlen_q=longest_q, seqlen_k=longest_k, varlen=True)

    decision = decide_keyed(key, problem, *forced)
    packed = Varlen(cu_seqlens_q, cu_seqlens_k, longest_q, longest_k, (tuple(bounds_q), tuple(bounds_k)))
    qh, kh, vh = (t.transpose(1, 2) for t in (q4, k4, v4))  # (1, heads, total, dim) views, the Call's order
    call = Call(qh, kh, vh, check_scale(scale, q.shape[-1]), mask, softcap=softcap, sinks=sinks,
                alibi_slopes=alibi_slopes, varlen=packed)
    return decision, call


def _traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, scale, softcap, sinks,
            alibi_slopes, return_lse, deterministic, backend):
    """Under torch.compile: one opaque custom op (op.attention_varlen_op), deciding when the graph runs as an eager
    call would; what only tracing knows (grad mode, requires_grad) is passed to it."""
    from .op import attention_varlen_op

    if mask.top_left or mask.tensor:  # (attention_varlen makes neither)
        raise InvalidInputError("attention_varlen takes causal and window_size only")
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sinks))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif type(scale) is not float:  # (a traced float may be symbolic: the op checks it when the graph runs)
        scale = check_scale(scale, q.shape[-1])
    out, lse = attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask.causal,
                                   mask.window[0], mask.window[1], scale, softcap, sinks, alibi_slopes, needs_grad,
                                   bool(return_lse), deterministic, backend)
    return (out, lse) if return_lse else out


# The last few offsets read to the host, by tensor: (weak references to cu_q and cu_k, their data pointers and
# version counters, the host tuples). A model's layers pass the same offsets tensors, so only the first layer's call
# waits for the device; an in-place change through torch bumps the version and is read again. (A write torch does
# not see, through a raw pointer, is not noticed: such offsets must be new tensors.) Tensors made under
# torch.inference_mode() have no version counter, so an in-place change to them cannot be seen: they are read on
# every call.
_READS: collections.OrderedDict = collections.OrderedDict()
_READS_KEPT = 8
_READS_LOCK = threading.Lock()


def _host_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Both offsets as host ints: one device-to-host copy, or none where these very tensors, unchanged, were read."""
    if cu_q.is_inference() or cu_k.is_inference():  # (no version counter to tell a change by)
        return _read_offsets(cu_q, cu_k)
    key = (id(cu_q), id(cu_k))
    stamp = (cu_q.data_ptr(), cu_q._version, cu_k.data_ptr(), cu_k._version)
    with _READS_LOCK:
        hit = _READS.get(key)
        if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k and hit[2] == stamp:
            _READS.move_to_end(key)
            return hit[3]
    out = _read_offsets(cu_q, cu_k)
    with _READS_LOCK:
        _READS[key] = (weakref.ref(cu_q), weakref.ref(cu_k), stamp, out)
        while len(_READS) > _READS_KEPT:
            _READS.popitem(last=False)
    return out


def _read_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Both offsets as host ints, in one device-to-host copy."""
    both = torch.cat((cu_q, cu_k)).tolist()
    return tuple(both[:cu_q.numel()]), tuple(both[cu_q.numel():])


def _offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, device) -> tuple[tuple, tuple]:
    """Both offsets as host ints (one device-to-host copy, none for offsets tensors already read and unchanged:
    _host_offsets), after checking they are what flash-attn takes: int32, 1-D, from 0 to the packed length,
    non-decreasing, on q's device."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise InvalidInputError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                                    f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
        if cu.device != device:
            raise InvalidInputError(f"{name} is on {cu.device} but q is on {device}")
    out = _host_offsets(cu_q, cu_k)
    for name, bounds, total in (("cu_seqlens_q", out[0], total_q), ("cu_seqlens_k", out[1], total_k)):
        if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise InvalidInputError(f"{name} must go from 0 to the packed length {total} without decreasing, got "
                                    f"{list(bounds) if len(bounds) <= 16 else [*bounds[:8], '...', *bounds[-4:]]}")
    return out


def _check_max(name: str, value, bounds: list[int]) -> int:
    """The longest sequence, after checking that ``value`` (flash-attn's max_seqlen) is an int that covers it."""
    longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    if isinstance(value, bool) or not isinstance(value, int) or value < longest:
        raise InvalidInputError(f"{name} must be an int at least the longest sequence ({longest}), got {value!r}")
    return longest


def _slopes(slopes, sequences: int, q: torch.Tensor) -> torch.Tensor:
    """``alibi_slopes`` (heads_q,) or (batch, heads_q) as the (batch, heads_q) fp32 rows the kernels read, one per
    sequence (fp64 for fp64 inputs)."""
    heads = q.shape[1]
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point() or \
            tuple(slopes.shape) not in ((heads,), (sequences, heads)):
        got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise InvalidInputError(f"alibi_slopes must be a float tensor of shape (heads_q,) = ({heads},) or (batch, "
                                f"heads_q) = ({sequences}, {heads}), got {got}")
    if slopes.device != q.device:
        raise InvalidInputError(f"q is on {q.device} but alibi_slopes is on {slopes.device}; put them on one device")
    slopes = slopes.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return (slopes.expand(sequences, heads) if slopes.dim() == 1 else slopes).contiguous()

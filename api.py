"""The public entry points: attention() and explain()."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .dispatch import device as devices
from .dispatch import registry
from .dispatch.call import Call
from .dispatch.decision import Decision
from .dispatch.mask import CAUSAL, NONE, Mask
from .dispatch.problem import (Problem, alibi_slopes_of, check_attn_mask, check_causal, check_deterministic,
                               check_dropout, check_scale, check_sinks, check_softcap, dtype_name, problem_from_tensors,
                               softcap_fields, torch_deterministic, validate_tensors)
from .dispatch.select import decide, decide_call, forced_backend
from .errors import BackendUnavailableError, InvalidInputError


def double_backward_error(backend: str | None) -> BackendUnavailableError:
    """The error a second-order gradient through a backend whose backward is a kernel raises."""
    which = f"backend {backend!r}" if backend else "attnforge's backward op (torch.compile)"
    return BackendUnavailableError(
        f"second-order gradients (double backward) are not supported through {which}: its backward is a "
        "kernel run from the saved output and LSE, not torch autograd; where a gradient is differentiated again, "
        "use backend='sdpa' inside torch.nn.attention.sdpa_kernel(SDPBackend.MATH) (torch autograd through "
        "SDPA's math kernel; torch's fused SDPA kernels have no second derivative either)")


class _NoDoubleBackward(torch.autograd.Function):
    """Passes first-order gradients through under create_graph=True and refuses to be differentiated: a kernel
    backward has no backward of its own, and autograd through what the backward happens to run in torch
    (the reference's ops, FP8's dequantisation) would be silently wrong. Its inputs are the ``count``
    gradients and then the tensors they depend on, so that a second differentiation reaches it."""

    @staticmethod
    def forward(ctx, backend, count, *tensors):
        ctx.backend = backend
        return tuple(g.clone() for g in tensors[:count])  # (clones: autograd may accumulate into them in place)

    @staticmethod
    def backward(ctx, *_):
        raise double_backward_error(ctx.backend)


def sink_gradient(sinks, out, lse, dout, dlse):
    """d loss / d sinks, whatever backend ran: a sink's share of row i is P_i = exp(sink - LSE_i) (the LSE
    counts the sink), and O_i = sum_j P_ij v_j moves by -P_i O_i per unit of sink while LSE_i moves by P_i,
    so the gradient is sum over batch and rows of P_i (dlse_i - rowsum(dO_i * O_i))."""
    acc = torch.promote_types(out.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    share = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))
    return -(share * delta).sum((0, 2)).to(sinks.dtype)


class _Attention(torch.autograd.Function):
    """Autograd glue for backends whose backward runs from the saved output and LSE: the decided forward
    Variant runs, and the decided backward Variant runs from what it saved."""

    @staticmethod
    def forward(ctx, q, k, v, descale, sinks, decision, call):
        call = call._replace(q=q, k=k, v=v, descale=descale, sinks=sinks)
        out, lse = registry.get(decision.forward.backend).forward(decision.forward.variant, call)
        ctx.save_for_backward(q, k, v, out, lse, descale, sinks)
        ctx.decision, ctx.call = decision, call._replace(q=None, k=None, v=None, descale=None, sinks=None)
        ctx.set_materialize_grads(False)  # an unused LSE (the usual call) gives dlse None, not a tensor of zeros
        return out, lse  # the LSE is differentiable: context-parallel merges and cascades differentiate through it

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, descale, sinks = ctx.saved_tensors
        choice = ctx.decision.backward
        if choice is None:
            raise BackendUnavailableError("attention was called with no input requiring grad, so no "
                                          "backward was chosen; set requires_grad before the call")
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        with torch.no_grad():
            grads = _Attention._gradients(ctx, choice, q, k, v, out, lse, descale, dout, dlse, sinks)
        if torch.is_grad_enabled():  # create_graph=True: a second differentiation must raise, not be wrong
            seeds = (dout,) if dlse is None else (dout, dlse)
            wrapped = _NoDoubleBackward.apply(choice.backend, len(grads), *grads, q, k, v, *seeds)
            grads = tuple(wrapped)
        return (*grads[:3], None, grads[3] if sinks is not None else None, None, None)

    @staticmethod
    def _gradients(ctx, choice, q, k, v, out, lse, descale, dout, dlse, sinks=None):
        bwd = registry.get(choice.backend)
        if descale is None:
            grads = bwd.backward(choice.variant, ctx.call._replace(q=q, k=k, v=v, sinks=sinks), out, lse, dout, dlse)
            if sinks is None:
                return grads
            return (*grads, sink_gradient(sinks, out, lse, dout, dlse))
        # FP8: the backward runs in bf16 on the dequantised inputs x * descale (see select.FP8_BACKWARD_DTYPE);
        # by the chain rule the gradient with respect to the fp8 tensor is descale * d(dequantised).
        per_head = [d.repeat_interleave(t.shape[1] // d.shape[1], 1)[:, :, None, None] for d, t in zip(descale, (q, k, v))]
        q, k, v = ((t.to(torch.float32) * d).to(out.dtype) for t, d in zip((q, k, v), per_head))
        # dlse folds into delta as without FP8: the LSE is of the dequantised scores, which this backward recomputes
        grads = bwd.backward(choice.variant, ctx.call._replace(q=q, k=k, v=v), out, lse, dout.to(out.dtype), dlse)
        return tuple(g.float() * d for g, d in zip(grads, per_head))  # autograd casts them to the inputs' dtype


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, dropout_p: float = 0.0, layout: str = "bhsd",
              return_lse: bool = False, backend: str | None = None, q_descale: torch.Tensor | None = None,
              k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
              alibi_slopes: torch.Tensor | None = None, deterministic: bool = False):
    """Exact attention softmax(q k^T * scale) v on the best backend for the device, dtype and shapes.

    q: (batch, heads_q, seqlen_q, head_dim), k: (batch, heads_kv, seqlen_k, head_dim),
    v: (batch, heads_kv, seqlen_k, head_dim_v) for ``layout="bhsd"``; ``"bshd"`` swaps heads and
    seqlen. heads_q must be a multiple of heads_kv (GQA/MQA). ``scale`` defaults to
    1/sqrt(head_dim). With ``causal``, query i sees key j iff j <= i + seqlen_k - seqlen_q
    (bottom-right, as FlashAttention); a row that sees no key gives 0. Returns the output in q's
    dtype and layout, and with ``return_lse`` also the natural-log LSE (batch, heads_q, seqlen_q)
    in fp32 (fp64 for fp64 inputs; -inf for rows that see no key), differentiable. ``backend`` forces one backend (see use_backend).
    FP8 (float8_e4m3fn q, k, v): the output is bf16, and ``q_descale``/``k_descale``/``v_descale``
    (fp32, (batch, heads_kv), positive, default 1) dequantise: the result is attention of descale * x.
    ``window_size=(left, right)``: a sliding window, FlashAttention's: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning unbounded; with
    ``causal``, right is 0. ``softcap`` > 0 caps the scaled scores as softcap * tanh(scores / softcap)
    (FlashAttention's ``softcap``, Gemma 2's ``attn_logit_softcapping``); 0 leaves them as they are.
    ``sinks``: a (heads_q,) float tensor of logits, one per query head, that count in every row's softmax
    denominator and carry no value (gpt-oss's attention sinks): a row attends "nowhere" by that share, and the
    LSE includes it. Differentiable. ``alibi_slopes``: (heads_q,) or (batch, heads_q) float slopes (FlashAttention's
    ALiBi): -slope * |i + seqlen_k - seqlen_q - j| is added to the (capped) scores; not differentiated.
    ``deterministic=True`` (FlashAttention's flag): the backward is bitwise reproducible from run to run; only
    backends whose backward sums in a fixed order serve it (the Decision says which do). The default takes the
    fastest backward, which may accumulate dQ with atomics. ``torch.use_deterministic_algorithms(True)`` binds a call
    that needs a backward as ``deterministic=True`` does (torch's own SDPA kernels, which follow it, stay eligible).
    """
    if deterministic is not False:  # (hot path: the default is one identity test)
        deterministic = check_deterministic(deterministic)
    if sinks is not None or alibi_slopes is not None:
        if getattr(q, "dtype", None) == torch.float8_e4m3fn:
            raise InvalidInputError("sinks and ALiBi with fp8 inputs are not supported")
        if torch.compiler.is_compiling():
            return _traced(q, k, v, _causal_mask(causal, window_size), scale, dropout_p, layout, return_lse, backend,
                           softcap=check_softcap(softcap), sinks=sinks, alibi_slopes=alibi_slopes,
                           deterministic=deterministic)
        return _run(q, k, v, _causal_mask(causal, window_size), scale, dropout_p, layout, return_lse, backend,
                    softcap=check_softcap(softcap), sinks=sinks, alibi_slopes=alibi_slopes,
                    deterministic=deterministic)
    if softcap.__class__ is not float or softcap:  # (hot path: the default 0.0 is one type test)
        softcap = check_softcap(softcap)
    # (getattr: q may be anything here; the validation in _run names what is wrong)
    fp8 = getattr(q, "dtype", None) == torch.float8_e4m3fn
    if fp8 or q_descale is not None or k_descale is not None or v_descale is not None:
        descales = (q_descale, k_descale, v_descale)
        if torch.compiler.is_compiling():
            raise InvalidInputError("fp8 attention inside torch.compile is not supported yet; call it eagerly")
        if not fp8 or not isinstance(k, torch.Tensor) or k.dim() != 4:
            validate_tensors(q, k, v, layout)  # names a q, k or v that is not a tensor first
        descale = _fp8_descale(q, k, descales, layout)
        return _run(q, k, v, _causal_mask(causal, window_size), scale, dropout_p, layout, return_lse, backend,
                    descale=descale, softcap=softcap, deterministic=deterministic)
    if torch.compiler.is_compiling():
        return _traced(q, k, v, _causal_mask(causal, window_size), scale, dropout_p, layout, return_lse, backend,
                       softcap=softcap, deterministic=deterministic)
    if window_size.__class__ is tuple and window_size == _UNBOUNDED:  # (hot path: inline)
        mask = CAUSAL if causal is True else NONE if causal is False else _causal_mask(causal)
    else:
        mask = _causal_mask(causal, window_size)
    return _run(q, k, v, mask, scale, dropout_p, layout, return_lse, backend, softcap=softcap,
                deterministic=deterministic)


_UNBOUNDED = (-1, -1)


def _causal_mask(causal, window_size=_UNBOUNDED) -> Mask:
    """The bottom-right causal mask or none, with a sliding window where given; a ``causal`` that is not a bool
    is refused (check_causal), as is a ``window_size`` that is not two integers >= -1."""
    causal = check_causal(causal)
    if window_size.__class__ is tuple and window_size == _UNBOUNDED:
        return CAUSAL if causal else NONE
    window = _check_window(window_size)
    if torch.compiler.is_compiling():  # (Dynamo traces through an lru_cache with a warning: build the Mask there)
        return _window_mask.__wrapped__(causal, window)
    return _window_mask(causal, window)


def _check_window(window_size) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)):
        raise InvalidInputError(f"window_size must be (left, right), two integers >= -1 (-1: unbounded), "
                                f"got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


@functools.lru_cache(maxsize=256)
def _window_mask(causal: bool, window: tuple[int, int]) -> Mask:
    if causal:  # causal bounds the right side at 0 (FlashAttention's right = 0): one Mask for every spelling
        window = (window[0], -1)
    return Mask(causal=causal, window=window)


def _fp8_descale(q, k, descales, layout) -> torch.Tensor:
    """The (3, batch, heads_kv) fp32 descales of an fp8 call, ones where not given."""
    if q.dtype != torch.float8_e4m3fn:
        raise InvalidInputError(f"q_descale/k_descale/v_descale apply to float8_e4m3fn inputs, got {q.dtype}")
    batch, heads_kv = k.shape[0], k.shape[2 if layout == "bshd" else 1]
    out = torch.ones(3, batch, heads_kv, dtype=torch.float32, device=q.device)
    for i, (name, d) in enumerate(zip(("q_descale", "k_descale", "v_descale"), descales)):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or d.shape != (batch, heads_kv) or not d.is_floating_point():
            raise InvalidInputError(f"{name} must be a float tensor of shape (batch, heads_kv) = ({batch}, {heads_kv}), "
                                    f"got {getattr(d, 'shape', type(d).__name__)}")
        out[i] = d.to(device=q.device, dtype=torch.float32)
    return out


def _traced(q, k, v, mask: Mask, scale, dropout_p, layout, return_lse, backend, attn_mask=None, softcap: float = 0.0,
            sinks=None, alibi_slopes=None, deterministic: bool = False):
    """Under torch.compile: one opaque custom op (see op.py). The op decides when the graph runs, as an eager
    call would; what only tracing knows (grad mode, requires_grad) is passed to it."""
    q, k, v = autocast_inputs(q, k, v)
    from .op import attention_op

    if sinks is not None:
        check_sinks(sinks, q, layout)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes_of(alibi_slopes, q, layout)

    if dropout_p:
        raise InvalidInputError("dropout_p > 0 inside torch.compile is not supported yet; call attention() eagerly")
    if attn_mask is not None and attn_mask.requires_grad:
        raise InvalidInputError("an attn_mask that requires grad is not supported inside torch.compile (the op "
                                "gives no gradient for it); call attnforge.sdpa eagerly")
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sinks))
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif type(scale) is not float:  # (a traced float may be symbolic: the op checks it when the graph runs)
        scale = check_scale(scale, q.shape[-1])
    out, lse = attention_op(q, k, v, attn_mask, mask.causal, mask.top_left, mask.window[0], mask.window[1], scale,
                            needs_grad, return_lse, backend, softcap, sinks, alibi_slopes, deterministic)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


_AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def autocast_inputs(q, k, v):
    """q, k and v as torch.autocast has SDPA see them: inside an enabled autocast region of their device, the
    fp32/fp16/bf16 ones in the autocast dtype (SDPA is on autocast's lower-precision list, so a step whose
    QK-norm leaves q and k in fp32 while v is bf16 runs in bf16); outside one, unchanged (mixed dtypes stay
    an error). The Decision then sees the dtype that runs; casting is differentiable."""
    if not isinstance(q, torch.Tensor):
        return q, k, v  # (the validation names what is wrong)
    device = "cuda" if q.is_cuda else q.device.type
    try:
        if not torch.is_autocast_enabled(device):
            return q, k, v
    except RuntimeError:  # a device type autocast does not know (meta): nothing to cast
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_DTYPES else t for t in (q, k, v))


def _run(q, k, v, mask: Mask, scale, dropout_p, layout, return_lse, backend, descale=None, attn_mask=None,
         softcap: float = 0.0, sinks=None, alibi_slopes=None, deterministic: bool = False):
    """Decide (a dict lookup for a repeated call signature), then run the decided Variants on one Call."""
    if descale is None:
        q, k, v = autocast_inputs(q, k, v)
    needs_grad = None
    if sinks is not None:
        check_sinks(sinks, q, layout)
        needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sinks))
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes_of(alibi_slopes, q, layout)
    decision = decide_call(q, k, v, layout, mask, dropout_p, return_lse, backend, needs_grad, softcap=softcap,
                           sinks=sinks is not None, alibi=alibi_slopes is not None, deterministic=deterministic)
    scale = check_scale(scale, q.shape[-1])
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    call = Call(q, k, v, scale, mask, dropout_p, descale, attn_mask, softcap, sinks, alibi_slopes)
    fwd = registry.get(decision.forward.backend)
    # the decision is per call signature, grad mode and requires_grad included: its problem says it
    if fwd.autograd_native or not decision.problem.needs_grad:  # no graph to record: skip autograd.Function (~10 us)
        out, lse = fwd.forward(decision.forward.variant, call)
    else:
        out, lse = _Attention.apply(q, k, v, descale, sinks, decision, call)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False):
    """torch.nn.functional.scaled_dot_product_attention's signature and meaning, dispatched by
    attnforge: switch with one import. Inputs are (..., heads, seqlen, head_dim) as in torch: 4-D is
    (batch, heads, seqlen, head_dim); more leading dims are flattened into the batch (they must be
    equal in query, key and value); a 3-D (N, L, E) or 2-D (L, E) input runs with its leading dim as
    the heads (the dim enable_gqa groups, as torch). Unlike attention(), ``is_causal`` is aligned
    top-left as in SDPA; calls the fast kernels cannot take (a mask tensor, top-left causal with
    seqlen_q != seqlen_k) go to a backend that can (``sdpa``), and the Decision
    (attnforge.last_decision()) says why. Where torch's SDPA runs, it runs under the caller's
    ``torch.nn.attention.sdpa_kernel(...)`` restriction; that restriction is about torch's kernels and
    does not stop attnforge's own (force torch's with ``attnforge.use_backend("sdpa")``)."""
    lead = _leading_dims(query, key, value)
    if lead is not None:  # not 4-D: run as (batch, heads, seqlen, head_dim), give back torch's shape
        query, key, value, attn_mask = _as_bhsd(query, key, value, attn_mask)
        out = sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out.reshape(*lead, *out.shape[-2:])
    is_causal = check_causal(is_causal, "is_causal")
    if attn_mask is not None and is_causal:
        raise InvalidInputError("pass attn_mask or is_causal=True, not both (as torch's SDPA)")
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 4:
        if query.shape[1] != key.shape[1] and not enable_gqa:
            raise InvalidInputError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                                    "for grouped-query attention (as torch's SDPA)")
        if attn_mask is not None:
            check_attn_mask(attn_mask, query, key)
        top_left = is_causal and query.shape[2] != key.shape[2]
    else:
        top_left = False  # attention()'s validation will name what is wrong
    if attn_mask is not None:
        mask = _TENSOR_MASK
    elif top_left:
        mask = _TOP_LEFT_CAUSAL
    else:
        mask = CAUSAL if is_causal else NONE
    if torch.compiler.is_compiling():
        return _traced(query, key, value, mask, scale, dropout_p, "bhsd", False, None, attn_mask=attn_mask)
    return _run(query, key, value, mask, scale, dropout_p, "bhsd", False, None, attn_mask=attn_mask)


def _leading_dims(query, key, value) -> tuple[int, ...] | None:
    """query's dims before (seqlen, head_dim) where sdpa() must reshape (not 4-D tensors), else None."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or query.dim() == key.dim() == value.dim() == 4:
        return None  # (attention()'s validation names what is not a tensor)
    dims = [t.dim() for t in tensors]
    if len(set(dims)) != 1 or dims[0] < 2:
        raise InvalidInputError(f"query, key and value must have the same number of dimensions, at least 2 "
                                f"((..., seqlen, head_dim) as torch's SDPA), got {dims[0]}, {dims[1]} and {dims[2]}")
    if dims[0] > 4 and not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise InvalidInputError(f"query, key and value must have the same batch dims, got {tuple(query.shape[:-3])}, "
                                f"{tuple(key.shape[:-3])} and {tuple(value.shape[:-3])} (expand them to broadcast)")
    return tuple(query.shape[:-2])


def _as_bhsd(query, key, value, attn_mask):
    """The 4-D views of sdpa()'s 2-D, 3-D or 5-D+ inputs: leading 1s prepended, or the dims before heads
    flattened into one batch; attn_mask (broadcasting to (..., seqlen_q, seqlen_k)) to match."""
    rank, query_batch = query.dim(), query.shape[:-3]
    query, key, value = (t.reshape(-1, *t.shape[-3:]) if rank > 4 else t.reshape((1,) * (4 - rank) + t.shape)
                         for t in (query, key, value))
    if not isinstance(attn_mask, torch.Tensor):
        return query, key, value, attn_mask  # (None, or something check_attn_mask names)
    if attn_mask.dim() > rank:
        raise InvalidInputError(f"attn_mask of shape {tuple(attn_mask.shape)} has more dims than query "
                                f"({rank}): it must broadcast to (..., seqlen_q, seqlen_k)")
    mask = attn_mask.reshape((1,) * (max(rank, 4) - attn_mask.dim()) + attn_mask.shape)
    if rank > 4:
        batch = mask.shape[:-3]
        if all(n == 1 for n in batch):
            mask = mask.reshape(1, *mask.shape[-3:])  # broadcasts over the flattened batch as it did
        elif any(m not in (1, n) for m, n in zip(batch, query_batch)):
            raise InvalidInputError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to query's "
                                    f"batch dims {tuple(query_batch)}")
        else:  # one flattened batch: the mask's batch dims expanded to query's (a copy only where they differ)
            mask = mask.expand(*query_batch, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])
    return query, key, value, mask


_TENSOR_MASK = Mask(tensor=True)
_TOP_LEFT_CAUSAL = Mask(causal=True, top_left=True)  # SDPA's is_causal where seqlen_q != seqlen_k


def explain(q: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
            device=None, dtype=None, head_dim: int | None = None, seqlen_q: int | None = None,
            seqlen_k: int | None = None, batch: int = 1, heads: int = 1, kv_heads: int | None = None,
            causal: bool = False, dropout_p: float = 0.0, needs_grad: bool = False,
            head_dim_v: int | None = None, return_lse: bool = False, layout: str = "bhsd",
            backend: str | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            sinks: bool = False, alibi: bool = False, deterministic: bool = False, kv_cache: str = "",
            kv_dtype: str = "", page_size: int = 0, varlen: bool = False) -> Decision:
    """The Decision attention() would take, without running anything.

    Give tensors (their shapes and dtype are used) or plain shapes (dtype, head_dim and seqlen_q
    required). ``device`` is a profile name (``"H100"``, ``"MI300X"``, ...; see PROFILES), a
    DeviceSpec or a torch device; default: the tensors' device, else this machine's. ``kv_cache="contiguous"`` or
    ``"paged"``: the Decision attention_with_kvcache would take (k, v then stand for the cache, seqlen_k for the
    longest sequence's keys; ``kv_dtype="fp8"`` for an e4m3 cache, ``"fp8_fnuz"`` for an e4m3fnuz one, ``page_size`` a paged cache's positions per page,
    which cute_sm90's paged kernel needs to know). ``varlen=True``: the Decision attention_varlen would take for a packed batch of
    ``batch`` sequences, the longest of ``seqlen_q`` queries and ``seqlen_k`` keys.
    """
    spec = None if device is None else devices.resolve(device)
    if q is not None or k is not None or v is not None:
        if q is None or k is None or v is None:
            raise InvalidInputError("explain() takes q, k and v together, or none of them and plain shapes")
        grad = needs_grad or q.requires_grad or k.requires_grad or v.requires_grad
        problem = problem_from_tensors(q, k, v, spec, layout=layout, mask=_causal_mask(causal, window_size),
                                       dropout_p=dropout_p, return_lse=return_lse, needs_grad=grad,
                                       softcap=check_softcap(softcap), sinks=bool(sinks), alibi=bool(alibi),
                                       deterministic=check_deterministic(deterministic),
                                       torch_deterministic=torch_deterministic(grad))
    else:
        missing = [n for n, x in (("dtype", dtype), ("head_dim", head_dim), ("seqlen_q", seqlen_q)) if x is None]
        if missing:
            raise InvalidInputError(f"explain() without tensors needs {', '.join(missing)}")
        problem = Problem(batch=batch, heads_q=heads, heads_kv=heads if kv_heads is None else kv_heads,
                          seqlen_q=seqlen_q, seqlen_k=seqlen_q if seqlen_k is None else seqlen_k,
                          head_dim=head_dim, head_dim_v=head_dim if head_dim_v is None else head_dim_v,
                          dtype=dtype_name(dtype), device=spec or devices.detect(),
                          mask=_causal_mask(causal, window_size),
                          dropout=check_dropout(dropout_p) > 0, needs_grad=bool(needs_grad),
                          return_lse=bool(return_lse), **softcap_fields(check_softcap(softcap)),
                          sinks=bool(sinks), alibi=bool(alibi),
                          deterministic=check_deterministic(deterministic) or torch_deterministic(needs_grad),
                          torch_deterministic=torch_deterministic(needs_grad))
    if kv_cache or varlen:
        problem = dataclasses.replace(problem, kv_cache=kv_cache, kv_dtype=kv_dtype, kv_page_size=page_size,
                                      varlen=bool(varlen))
    return decide(problem, *forced_backend(backend))

"""attention() as a torch.library custom op, so torch.compile(fullgraph=True) traces models that
call it without graph breaks: the op is opaque to the compiler (the dispatcher and the kernels run
when the compiled graph runs), fake implementations give shapes, and autograd is registered.

Eager calls do not go through the op (its dispatch costs more than attnforge's whole host path);
attention() and attnforge.sdpa() route here only while torch.compile is tracing. When the compiled
graph runs, the op decides exactly as an eager call with the same inputs would (the same Decision,
cached per call signature, reported by last_decision() and decisions()): the forward on its forward
backend, the backward on its backward backend. ``needs_grad`` is fixed when the graph is traced (grad
mode and requires_grad, as eager sees them), since inside the op no input requires grad.

One difference is forced by the op boundary: a forward whose backward is torch autograd through it
(the ``sdpa`` backend) cannot keep its autograd graph across two ops, so the backward op runs that
forward again under autograd and differentiates it (the same kernels and numbers as eager, at the
cost of one more forward).
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import registry
from .dispatch.call import Call
from .dispatch.mask import Mask
from .dispatch.problem import check_scale, check_softcap


def _mask(attn_mask: Optional[torch.Tensor], causal: bool, top_left: bool, window: tuple[int, int]) -> Mask:
    if attn_mask is not None:
        return Mask(tensor=True)
    return Mask(causal=causal, top_left=top_left and (causal or window != (-1, -1)), window=window)


def _decide(q, k, v, attn_mask, causal, top_left, window, scale, needs_grad, return_lse, backend, softcap, sinks,
            alibi_slopes, deterministic):
    """The Decision an eager call with these inputs takes (and that last_decision() then reports), and its Call."""
    from .dispatch.select import decide_call

    mask = _mask(attn_mask, causal, top_left, window)
    decision = decide_call(q, k, v, "bhsd", mask, 0.0, return_lse, backend, needs_grad=needs_grad,
                           softcap=softcap, sinks=sinks is not None, alibi=alibi_slopes is not None,
                           deterministic=deterministic)
    call = Call(q, k, v, scale, mask, attn_mask=attn_mask, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    return decision, call


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs as eager attention() gives it (an fp32 LSE would make fp64 gradients fp32-exact)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q: torch.Tensor, needs_grad: bool, return_lse: bool) -> tuple[int, ...]:
    """The op's LSE output: (batch, heads, seqlen_q) where the caller or the backward uses it, else empty."""
    return (*q.shape[:3],) if needs_grad or return_lse else (*q.shape[:2], 0)


@torch.library.custom_op("attnforge::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], causal: bool,
                 top_left: bool, window_left: int, window_right: int, scale: float, needs_grad: bool,
                 return_lse: bool, backend: Optional[str], softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                 alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for (batch, heads, seqlen, dim) inputs, by the Decision an eager call would take. The LSE is
    (batch, heads, seqlen_q) when ``return_lse`` or ``needs_grad``, else (batch, heads, 0). ``alibi_slopes`` comes
    as attention() makes it (problem.alibi_slopes_of: (batch, heads_q) fp32)."""
    scale = check_scale(scale, q.shape[-1])  # (traced as a graph input, it is first seen here)
    softcap = check_softcap(softcap)  # (likewise)
    decision, call = _decide(q, k, v, attn_mask, causal, top_left, (window_left, window_right), scale, needs_grad,
                             return_lse, backend, softcap, sinks, alibi_slopes, deterministic)
    out, lse = registry.get(decision.forward.backend).forward(decision.forward.variant, call)
    shape = _lse_shape(q, needs_grad, return_lse)
    if not shape[-1]:  # no one uses it
        lse = q.new_empty(shape, dtype=lse_dtype(q))
    elif lse is None:  # a backend without an LSE (sdpa) declines return_lse; its backward recomputes, using none
        lse = q.new_full(shape, float("nan"), dtype=lse_dtype(q))
    return out.contiguous(), lse.to(lse_dtype(q)).contiguous()


@attention_op.register_fake
def _(q, k, v, attn_mask, causal, top_left, window_left, window_right, scale, needs_grad, return_lse, backend,
      softcap=0.0, sinks=None, alibi_slopes=None, deterministic=False):
    # exactly what the real op returns: contiguous out in q's dtype and contiguous LSE (new_empty is contiguous)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(_lse_shape(q, needs_grad, return_lse),
                                                                dtype=lse_dtype(q))


@torch.library.custom_op("attnforge::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                          dlse: Optional[torch.Tensor], causal: bool, top_left: bool, window_left: int,
                          window_right: int, scale: float, return_lse: bool, backend: Optional[str],
                          softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                          alibi_slopes: Optional[torch.Tensor] = None,
                          deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by the backward of the Decision the forward op took; ``dlse``, the LSE's gradient (None where
    the LSE is not used), folds into the backward's delta. (The sinks' gradient is the autograd formula's.)"""
    decision, call = _decide(q, k, v, attn_mask, causal, top_left, (window_left, window_right), scale, True,
                             return_lse, backend, softcap, sinks, alibi_slopes, deterministic)
    choice = decision.backward
    if choice.variant is None and registry.get(choice.backend).autograd_native:
        grads = _recomputed_gradients(registry.get(decision.forward.backend), decision.forward.variant, call, dout)
    else:
        grads = registry.get(choice.backend).backward(choice.variant, call, out, lse, dout, dlse)
    return tuple(g.contiguous() for g in grads)


def _recomputed_gradients(backend, variant, call: Call, dout):
    """Gradients of an autograd-native forward (torch SDPA): run it again under autograd and differentiate it."""
    with _autograd_inside_op(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (call.q, call.k, call.v))
        out, _ = backend.forward(variant, call._replace(q=q, k=k, v=v))
        return torch.autograd.grad(out, (q, k, v), dout)


def _autograd_inside_op():
    """A custom op's implementation runs with the autograd dispatch keys excluded (torch.library's autograd
    wrapper redispatches below autograd), so no graph would be recorded: re-include them for the recompute.
    The exclusion is thread-local dispatcher state; the guard restores it on exit. Autocast stays excluded
    (the inputs are already in the dtype that runs)."""
    C = torch._C
    autograd = C.DispatchKeySet(C.DispatchKey.AutogradFunctionality) | C.DispatchKeySet(C.DispatchKey.ADInplaceOrView)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), C._dispatch_tls_local_exclude_set() - autograd)


@attention_backward_op.register_fake
def _(dout, q, k, v, attn_mask, out, lse, dlse, causal, top_left, window_left, window_right, scale, return_lse,
      backend, softcap=0.0, sinks=None, alibi_slopes=None, deterministic=False):
    # contiguous, as the real op returns them (empty_like would copy the inputs' strides: bshd, transposed views)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, causal, top_left, window_left, window_right, scale, needs_grad, return_lse, backend, softcap,
     sinks, alibi_slopes, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, attn_mask, out, lse, sinks, alibi_slopes)
    ctx.flags = causal, top_left, window_left, window_right, scale, return_lse, backend, softcap, deterministic


def _backward(ctx, dout, dlse):
    from .api import sink_gradient

    q, k, v, attn_mask, out, lse, sinks, alibi_slopes = ctx.saved_tensors
    causal, top_left, window_left, window_right, scale, return_lse, backend, softcap, deterministic = ctx.flags
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = None if dlse is None or not return_lse else dlse.to(lse.dtype).contiguous()
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, attn_mask, out, lse, dlse, causal, top_left,
                                       window_left, window_right, scale, return_lse, backend, softcap, sinks,
                                       alibi_slopes, deterministic)
    dsinks = None if sinks is None else sink_gradient(sinks, out, lse, dout, dlse)
    return dq, dk, dv, *(None,) * 10, dsinks, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_setup_context(ctx, inputs, output):
    ctx.backend = inputs[-1]


def _double_backward(ctx, *_):
    from .api import double_backward_error

    raise double_backward_error(ctx.backend)


# The backward op's own backward: a second-order gradient through a kernel backward is refused, with the
# reason, instead of torch's "no autograd formula" (or a silently wrong one).
attention_backward_op.register_autograd(_double_backward, setup_context=_backward_setup_context)


# attention_varlen as custom ops: a packed batch (total, heads, dim) with cu_seqlens, read on the host when the
# graph runs (the real op), never while tracing. The same rules as the dense ops above: the op decides as an eager
# call would (varlen.decide), the backward runs that Decision's backward (or differentiates an autograd-native
# forward again), and a second differentiation is refused.

def _varlen_lse_shape(q: torch.Tensor, needs_grad: bool, return_lse: bool) -> tuple[int, int]:
    """The op's LSE output: (heads, total_q) where the caller or the backward uses it, else (heads, 0)."""
    return (q.shape[1], q.shape[0] if needs_grad or return_lse else 0)


def _varlen_decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
                   window_right, scale, softcap, sinks, alibi_slopes, needs_grad, return_lse, deterministic, backend):
    from .varlen import decide

    mask = _mask(None, causal, False, (window_left, window_right))
    return decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, check_scale(scale, q.shape[-1]),
                  check_softcap(softcap), sinks, alibi_slopes, return_lse, needs_grad, deterministic, backend)


@torch.library.custom_op("attnforge::attention_varlen", mutates_args=())
def attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        window_left: int, window_right: int, scale: float, softcap: float,
                        sinks: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], needs_grad: bool,
                        return_lse: bool, deterministic: bool,
                        backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, heads_q, dim_v), LSE (heads_q, total_q), or (heads_q, 0) when neither ``return_lse`` nor
    ``needs_grad``) of a packed batch, by the Decision an eager attention_varlen call would take."""
    decision, call = _varlen_decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    window_left, window_right, scale, softcap, sinks, alibi_slopes, needs_grad,
                                    return_lse, deterministic, backend)
    out, lse = registry.get(decision.forward.backend).forward(decision.forward.variant, call)
    shape = _varlen_lse_shape(q, needs_grad, return_lse)
    if not shape[-1]:
        lse = q.new_empty(shape, dtype=lse_dtype(q))
    elif lse is None:  # a backend without an LSE (sdpa) declines return_lse; its backward recomputes, using none
        lse = q.new_full(shape, float("nan"), dtype=lse_dtype(q))
    else:
        lse = lse[0]
    return out[0].transpose(0, 1).contiguous(), lse.to(lse_dtype(q)).contiguous()


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
      softcap, sinks, alibi_slopes, needs_grad, return_lse, deterministic, backend):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty(_varlen_lse_shape(q, needs_grad, return_lse), dtype=lse_dtype(q)))


@torch.library.custom_op("attnforge::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                 max_seqlen_k: int, out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                                 causal: bool, window_left: int, window_right: int, scale: float, softcap: float,
                                 sinks: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                                 return_lse: bool, deterministic: bool,
                                 backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a packed batch by the backward of the Decision the forward op took."""
    decision, call = _varlen_decide(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    window_left, window_right, scale, softcap, sinks, alibi_slopes, True, return_lse,
                                    deterministic, backend)
    choice = decision.backward
    dout4 = dout.unsqueeze(0).transpose(1, 2)
    if choice.variant is None and registry.get(choice.backend).autograd_native:
        grads = _recomputed_gradients(registry.get(decision.forward.backend), decision.forward.variant, call, dout4)
    else:
        grads = registry.get(choice.backend).backward(choice.variant, call, out.unsqueeze(0).transpose(1, 2),
                                                      lse.unsqueeze(0), dout4,
                                                      None if dlse is None else dlse.unsqueeze(0))
    return tuple(g[0].transpose(0, 1).contiguous() for g in grads)


@attention_varlen_backward_op.register_fake
def _(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, dlse, causal, window_left,
      window_right, scale, softcap, sinks, alibi_slopes, return_lse, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, softcap,
     sinks, alibi_slopes, needs_grad, return_lse, deterministic, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, sinks, alibi_slopes)
    ctx.flags = (max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, softcap, return_lse,
                 deterministic, backend)


def _varlen_backward(ctx, dout, dlse):
    from .api import sink_gradient

    q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, sinks, alibi_slopes = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, softcap, return_lse, deterministic,
     backend) = ctx.flags
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = None if dlse is None or not return_lse else dlse.to(lse.dtype).contiguous()
    dq, dk, dv = attention_varlen_backward_op(dout.contiguous(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, out, lse, dlse, causal, window_left, window_right, scale,
                                              softcap, sinks, alibi_slopes, return_lse, deterministic, backend)
    dsinks = None
    if sinks is not None:  # the dense formula on (1, heads, total) views of the packed output, LSE and dO
        dsinks = sink_gradient(sinks, out.unsqueeze(0).transpose(1, 2), lse.unsqueeze(0),
                               dout.unsqueeze(0).transpose(1, 2), None if dlse is None else dlse.unsqueeze(0))
    return dq, dk, dv, *(None,) * 9, dsinks, *(None,) * 5


attention_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
attention_varlen_backward_op.register_autograd(_double_backward, setup_context=_backward_setup_context)


# attention_with_kvcache as custom ops: the lengths, left pads and block table are read on the host when the graph
# runs (the real op calls the eager function, which checks them as an eager call does), never while tracing. Two ops,
# so that only a call that appends new keys and values is a mutation of the caches for the compiler (a read-only op
# lets it keep the caches as they are; a mutating one it must order, or copy where it cannot reinplace). No autograd:
# attention_with_kvcache has no backward (as flash-attn's).

def _kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, seqlens_value, block_table, cache_leftpad, causal, scale,
                     window_left, window_right, softcap, sinks, num_splits, check_inputs, k_descale, v_descale,
                     backend):
    from .kvcache import attention_with_kvcache

    out, lse = attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens if cache_seqlens is not None else (
            None if seqlens_value < 0 else seqlens_value), block_table=block_table, cache_leftpad=cache_leftpad,
        causal=causal, scale=scale, window_size=(window_left, window_right), softcap=softcap, sinks=sinks,
        num_splits=num_splits, return_lse=True, backend=backend, check_inputs=check_inputs, k_descale=k_descale,
        v_descale=v_descale)
    return out.contiguous(), lse.contiguous()


def _kvcache_fake(q, v_cache):
    # contiguous, as the real op returns them: out (batch, seqlen_q, heads_q, dim_v) in q's dtype, LSE fp32
    return (q.new_empty((*q.shape[:3], v_cache.shape[3])),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


@torch.library.custom_op("attnforge::attention_with_kvcache", mutates_args=())
def attention_with_kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: Optional[torch.Tensor], seqlens_value: int,
                              block_table: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor], causal: bool,
                              scale: Optional[float], window_left: int, window_right: int, softcap: float,
                              sinks: Optional[torch.Tensor], num_splits: int, check_inputs: bool,
                              k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
                              backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, LSE) of attention_with_kvcache without new keys (the caches are read only), by the Decision an eager
    call would take. ``cache_seqlens`` a (batch,) int32 tensor, or None with ``seqlens_value`` the int given (-1:
    none given, the whole cache)."""
    return _kvcache_forward(q, k_cache, v_cache, None, None, cache_seqlens, seqlens_value, block_table, cache_leftpad,
                            causal, scale, window_left, window_right, softcap, sinks, num_splits, check_inputs,
                            k_descale, v_descale, backend)


@attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, seqlens_value, block_table, cache_leftpad, causal, scale, window_left,
      window_right, softcap, sinks, num_splits, check_inputs, k_descale, v_descale, backend):
    return _kvcache_fake(q, v_cache)


@torch.library.custom_op("attnforge::attention_with_kvcache_append", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_append_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                                     v: torch.Tensor, cache_seqlens: Optional[torch.Tensor], seqlens_value: int,
                                     block_table: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                                     causal: bool, scale: Optional[float], window_left: int, window_right: int,
                                     softcap: float, sinks: Optional[torch.Tensor], num_splits: int,
                                     check_inputs: bool, k_descale: Optional[torch.Tensor],
                                     v_descale: Optional[torch.Tensor],
                                     backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_kvcache_op with new keys ``k`` and values ``v`` written into the caches in place first."""
    return _kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, seqlens_value, block_table, cache_leftpad,
                            causal, scale, window_left, window_right, softcap, sinks, num_splits, check_inputs,
                            k_descale, v_descale, backend)


@attention_with_kvcache_append_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, seqlens_value, block_table, cache_leftpad, causal, scale, window_left,
      window_right, softcap, sinks, num_splits, check_inputs, k_descale, v_descale, backend):
    return _kvcache_fake(q, v_cache)

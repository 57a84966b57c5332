"""attention() as a torch.library custom op, so torch.compile(fullgraph=True) traces models that
call it without graph breaks: the op is opaque to the compiler (the dispatcher and the kernels run
when the compiled graph runs), fake implementations give shapes, and autograd is registered.

Eager calls do not go through the op (its dispatch costs more than attnforge's whole host path);
attention() routes here only while torch.compile is tracing. There, autograd-native backends
(torch SDPA) are passed over for the best one with its own backward (triton_fa2 on NVIDIA,
triton_rocm on CDNA, reference on the CPU): see _plan().
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import registry
from .dispatch.call import Call
from .dispatch.mask import CAUSAL, NONE


def _plan(q, k, v, causal, backend):
    """(backend, forward Variant, backward Variant) the op runs: the best backend the Decision found serving
    the forward whose own backward runs from the saved output and LSE. Autograd-native backends (torch
    SDPA) are passed over here: inside an op, autograd cannot run through them, and the op's backward
    must be an op too."""
    from .dispatch.decision import CHOSEN, ELIGIBLE
    from .dispatch.problem import problem_from_tensors
    from .dispatch.select import decide, forced_backend
    from .errors import BackendUnavailableError

    problem = problem_from_tensors(q, k, v, mask=CAUSAL if causal else NONE, needs_grad=True)
    decision = decide(problem, *forced_backend(backend))
    for c in decision.forward.candidates:
        if c.verdict in (CHOSEN, ELIGIBLE):
            b = registry.get(c.backend)
            if b.autograd_native:
                continue
            fwd, _ = b.plan(problem)
            bwd, _ = b.plan_backward(problem)
            if fwd is not None and bwd is not None:
                return b, fwd, bwd
    raise BackendUnavailableError("under torch.compile attnforge needs a backend whose backward runs from the "
                                  f"saved output and LSE, and none serves this call:\n{decision}")


@torch.library.custom_op("attnforge::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for (batch, heads, seqlen, dim) inputs."""
    b, fwd, _ = _plan(q, k, v, causal, backend)
    out, lse = b.forward(fwd, Call(q, k, v, scale, CAUSAL if causal else NONE))
    return out.contiguous(), lse.to(_lse_dtype(q)).contiguous()


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs as eager attention() gives it (an fp32 LSE would make fp64 gradients fp32-exact)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@attention_op.register_fake
def _(q, k, v, causal, scale, backend):
    # exactly what the real op returns: contiguous out in q's dtype and contiguous LSE (new_empty is contiguous)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


@torch.library.custom_op("attnforge::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool, scale: float,
                          backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward op's output and LSE, by the backend that ran the forward; ``dlse``, the
    LSE's gradient (None where the LSE is not used), folds into the backward's delta."""
    b, _, bwd = _plan(q, k, v, causal, backend)
    grads = b.backward(bwd, Call(q, k, v, scale, CAUSAL if causal else NONE), out, lse, dout, dlse)
    return tuple(g.contiguous() for g in grads)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, backend):
    # contiguous, as the real op returns them (empty_like would copy the inputs' strides: bshd, transposed views)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = None if dlse is None else dlse.to(lse.dtype).contiguous()
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, dlse, ctx.causal, ctx.scale,
                                       ctx.backend)
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def _backward_setup_context(ctx, inputs, output):
    ctx.backend = inputs[-1]


def _double_backward(ctx, *_):
    from .api import double_backward_error

    raise double_backward_error(ctx.backend)


# The backward op's own backward: a second-order gradient through a kernel backward is refused, with the
# reason, instead of torch's "no autograd formula" (or a silently wrong one).
attention_backward_op.register_autograd(_double_backward, setup_context=_backward_setup_context)

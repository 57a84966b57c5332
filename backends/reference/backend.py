"""The last resort on every device and, fed fp64, the oracle the other backends are tested against."""

from __future__ import annotations

import torch

from ...dispatch.problem import Problem
from ...dispatch.registry import Backend, Planned
from ...dispatch.support import Support
from ...dispatch.variant import TorchVariant
from . import kernels


def _no_autocast(t):
    return torch.autocast(t.device.type, enabled=False)


class ReferenceBackend(Backend):
    name = "reference"
    summary = "attnforge's tiled online softmax in PyTorch, fp32 accumulation (fp64 for fp64 inputs)"
    last_resort = True
    support = Support(
        vendors=frozenset({"nvidia", "amd", "cpu"}),
        dtypes=frozenset({"fp16", "bf16", "fp32", "fp64"}),
        top_left=True, window=True,  # the mask model's rule, written once in torch (dispatch/mask.py)
        softcap=True, sinks=True, alibi=True,
        dropout=False,  # the dropout mask would have to be regenerated in backward; sdpa serves dropout
    )

    def _variant(self, problem: Problem) -> TorchVariant:
        acc = "fp64" if problem.dtype == "fp64" else "fp32"
        return TorchVariant(f"torch ops, key tiles of {kernels.BLOCK_N}, {acc} accumulation")

    def _plan(self, problem: Problem) -> Planned:
        return self._variant(problem), []

    def _plan_backward(self, problem: Problem) -> Planned:
        return self._variant(problem), []

    def forward(self, variant, call):
        with _no_autocast(call.q):  # its fp32 (fp64) accumulation is the point: autocast must not lower it
            return kernels.forward(call.q, call.k, call.v, mask=call.mask, scale=call.scale, softcap=call.softcap,
                                   sinks=call.sinks, alibi_slopes=call.alibi_slopes)

    def backward(self, variant, call, out, lse, dout, dlse=None):
        with _no_autocast(call.q):
            return kernels.backward(call.q, call.k, call.v, out, lse, dout, mask=call.mask, scale=call.scale, dlse=dlse,
                                    softcap=call.softcap, alibi_slopes=call.alibi_slopes)

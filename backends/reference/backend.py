"""The last resort on every device and, fed fp64, the oracle the other backends are tested against."""

from __future__ import annotations

from ...dispatch.problem import Problem
from ...dispatch.registry import Backend
from ...dispatch.support import Support
from . import kernels


class ReferenceBackend(Backend):
    name = "reference"
    summary = "attnforge's tiled online softmax in PyTorch, fp32 accumulation (fp64 for fp64 inputs)"
    support = Support(
        vendors=frozenset({"nvidia", "amd", "cpu"}),
        dtypes=frozenset({"fp16", "bf16", "fp32", "fp64"}),
        dropout=False,  # the dropout mask would have to be regenerated in backward; sdpa serves dropout
    )

    def variant(self, problem: Problem) -> str:
        acc = "fp64" if problem.dtype == "fp64" else "fp32"
        return f"torch ops, key tiles of {kernels.BLOCK_N}, {acc} accumulation"

    def forward(self, q, k, v, *, causal, scale, dropout_p, **mask):
        return kernels.forward(q, k, v, causal=causal, scale=scale)

    def backward(self, q, k, v, out, lse, dout, *, causal, scale):
        return kernels.backward(q, k, v, out, lse, dout, causal=causal, scale=scale)

"""FlashAttention-4-style forward for Blackwell (sm100) in the CuTe DSL: tcgen05 MMAs into tensor memory.

Kernels are rendered from templates/cute_sm100_fwd.py.jinja into _generated/, one per variant of
variants.py, and compiled for sm_100a (compile.py). Compiled and checked in SASS on machines with no
Blackwell GPU; never run on one yet, which is what the self-check on first use is for. Forward only:
the backward is triton_fa2's, from this forward's LSE.
"""

from __future__ import annotations

import functools

import torch

from ...dispatch.problem import Problem
from ...dispatch.registry import Backend
from ...dispatch.support import Support
from ..cute_sm90.backend import _DTYPE_NAME, LOG2_E, _lse_prototype, _tma_ready, cute_stack_missing
from ..inputs import nonnegative_scale
from . import compile as cc
from . import variants


class CuteSm100Backend(Backend):
    name = "cute_sm100"
    summary = "tcgen05 + TMEM forward in the CuTe DSL (templates/cute_sm100_fwd.py.jinja); compiled, not yet run"
    support = Support(
        vendors=frozenset({"nvidia"}),
        archs=frozenset({"sm100"}),
        dtypes=frozenset({"fp16", "bf16"}),
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,
        backward=False,  # triton_fa2's backward runs from this forward's LSE
        empty=False,
    )

    def available(self) -> list[str]:
        return cute_stack_missing()

    def supports(self, problem: Problem) -> list[str]:
        reasons = self.support.reasons(problem)
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        if problem.head_dim <= max(variants.HEAD_DIMS):
            reasons += variants.pick(problem.head_dim)[1]
        return reasons

    def variant(self, problem: Problem) -> str:
        tile, _ = variants.pick(problem.head_dim)
        return f"fwd {tile.describe()}" if tile else ""

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def module(head_dim: int) -> str:
        tile, reasons = variants.pick(head_dim)
        if tile is None:
            raise RuntimeError("; ".join(reasons))
        return tile.module(head_dim)

    def forward(self, q, k, v, *, causal, scale, dropout_p, **mask):
        q, scale = nonnegative_scale(q, scale)
        q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
        kernel = cc.compiled(self.module(q.shape[-1]), _DTYPE_NAME[q.dtype], causal)
        out = torch.empty_like(q)
        lse = torch.empty_like(_lse_prototype(q.shape[:3], q.device))
        kernel(q, k, v, out, lse, scale * LOG2_E)
        return out, lse

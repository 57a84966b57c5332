"""FlashAttention-4-style forward for Blackwell (sm100) in the CuTe DSL: tcgen05 MMAs into tensor memory.

Kernels are rendered from templates/cute_sm100_fwd.py.jinja into the cache, one module per tile of
variants.py, and compiled for sm_100a (runtime/cute.py). Compiled and checked in SASS on machines with no
Blackwell GPU; never run on one yet, which is what the self-check on first use is for. Forward only:
the backward is triton_fa2's, from this forward's LSE.
"""

from __future__ import annotations

import dataclasses

import torch

from ...codegen import Source
from ...dispatch.problem import Problem
from ...dispatch.registry import Backend, Planned
from ...dispatch.support import Support
from ..shared.cute_host import (SCORE_FEATURES, CuteVariant, feature_flags, lse_like, problem_features, stack_missing,
                                tma_ready, trailing_arguments)
from ..shared.inputs import nonnegative_scale
from . import compile as cc
from . import variants


@dataclasses.dataclass(frozen=True)
class Sm100Variant(CuteVariant):
    """One compiled cute_sm100 forward: a tile for a head dim, compiled for a dtype and causality; ``window``,
    ``softcap``, ``sinks`` and ``alibi`` compile the template's WINDOW, SOFTCAP, SINKS and ALIBI in (their values
    are the call's), ``varlen`` its VARLEN (a packed batch)."""

    tile: variants.Sm100FwdTile
    head_dim: int
    dtype: str
    causal: bool
    window: bool = False
    softcap: bool = False
    sinks: bool = False
    alibi: bool = False
    varlen: bool = False
    compile_module = cc

    @property
    def module(self) -> str:
        return self.tile.module(self.head_dim) + self.feature_suffix

    @property
    def source(self) -> Source:
        return Source.of(cc.TEMPLATE, self.tile.params(self.head_dim, self.window, self.softcap, self.sinks, self.alibi,
                                                       self.varlen), self.module)


class CuteSm100Backend(Backend):
    name = "cute_sm100"
    summary = "tcgen05 + TMEM forward in the CuTe DSL (templates/cute_sm100_fwd.py.jinja); compiled, not yet run"
    support = Support(
        vendors=frozenset({"nvidia"}),
        archs=frozenset({"sm100"}),
        dtypes=frozenset(cc.DTYPES),
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,
        backward=False,  # triton_fa2's backward runs from this forward's LSE
        empty=False,
        window=True,  # WINDOW kernels
        softcap=True,  # SOFTCAP kernels
        sinks=True,  # SINKS kernels (dsinks comes from the output and LSE)
        alibi=True,  # ALIBI kernels
        varlen=True,  # VARLEN kernels (a packed batch; triton_fa2's VARLEN backward follows them)
    )

    def available(self) -> list[str]:
        return stack_missing()

    def _plan(self, problem: Problem) -> Planned:
        reasons = []
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        tile, why = variants.pick(problem.head_dim)
        reasons += why
        if reasons:
            return None, reasons
        return Sm100Variant(tile, problem.head_dim, problem.dtype, problem.causal, **problem_features(problem),
                            varlen=problem.varlen), []

    def variants(self, archs=None, dtypes=None, head_dims=None, causal=(False, True), strict=False,
                 deterministic=False, features=()) -> list[Sm100Variant]:
        if archs is not None and "sm100" not in archs:
            return []
        out = []
        for dtype in dtypes or cc.DTYPES:
            if dtype not in cc.DTYPES:
                continue  # fp8 is not built for sm100 yet
            for head_dim in head_dims or variants.HEAD_DIMS:
                tile, why = variants.pick(head_dim)
                if tile is None:
                    if strict:
                        raise ValueError("cute_sm100: " + "; ".join(why))  # the reason already says "head_dim N"
                    continue
                out += [Sm100Variant(tile, head_dim, dtype, flag) for flag in causal]
                out += [Sm100Variant(tile, head_dim, dtype, flag, **feature_flags(kinds), varlen="varlen" in kinds)
                        for kinds in features if kinds and kinds <= {*SCORE_FEATURES, "varlen"} for flag in causal]
        return out

    def builds(self, variant: Sm100Variant) -> list:
        return [variant.build]

    def forward(self, variant: Sm100Variant, call):
        q, scale = nonnegative_scale(call.q, call.scale)
        q, k, v = tma_ready(q), tma_ready(call.k), tma_ready(call.v)
        out = torch.empty_like(q)
        lse = lse_like(q.shape[:3], q.device)
        scores, scale_log2 = trailing_arguments(variant, call, scale)
        variant.kernel(q, k, v, out, lse, scale_log2, *scores)
        return out, lse

"""FlashAttention-3-style forward for Hopper (sm90) in the CuTe DSL: TMA, WGMMA, warp specialization.

Kernels are rendered from templates/cute_sm90_fwd.py.jinja into the cache, one module per tile of
variants.py; runtime/cute.py compiles them (once per machine, cached on disk) and calls them through TVM
FFI. The backward (templates/cute_sm90_bwd.py.jinja, tiles in bwd_variants.py, host side in backward.py)
serves 16-bit head dims 64 and 128 (packed batches: see bwd_variants.PACKED); the others go to the next backend's
backward, and the Decision shows that choice.
"""

from __future__ import annotations

import dataclasses

import torch

from ...codegen import Source
from ...dispatch import costs as cost_model
from ...dispatch.problem import Problem
from ...dispatch.registry import Backend, Planned, registered
from ...dispatch.support import Support
from ..shared.cute_host import (SCORE_FEATURES, CuteVariant, feature_flags, lse_like, max_ctas, problem_features,
                                stack_missing, tma_ready, trailing_arguments)
from ..shared.inputs import TINY_SCALE, nonnegative_scale
from . import compile as cc
from . import backward as bwd
from . import bwd_variants, tail_split, variants
from .v_layout import aot_build, prepare_v_fp8


@dataclasses.dataclass(frozen=True)
class Sm90Variant(CuteVariant):
    """One compiled cute_sm90 forward: a tile of the table for an input kind and head dim, compiled for a
    dtype and causality (``kernel``: the compiled callable); ``window``, ``softcap``, ``sinks`` and ``alibi``
    compile the template's WINDOW, SOFTCAP, SINKS and ALIBI in (their values are the call's), ``varlen`` its VARLEN
    (a packed batch), ``kv_cache`` its KV_CACHE ("contiguous") or KV_CACHE and PAGED ("paged", loading
    ``page_rows`` rows at a time: variants.page_rows)."""

    tile: variants.Sm90FwdTile
    kind: str
    head_dim: int
    dtype: str
    causal: bool
    window: bool = False
    softcap: bool = False
    sinks: bool = False
    alibi: bool = False
    varlen: bool = False
    # FIXED_MAX in the template: a softcapped bf16 forward subtracts one fixed max (the cap bounds the scores)
    # instead of a running one; only for caps up to dispatch.problem.SMALL_SOFTCAP (variants.fixed_max_serves)
    fixed_max: bool = False
    kv_cache: str = ""
    page_rows: int = 0
    compile_module = cc

    @property
    def module(self) -> str:
        fixed = "_fixedmax" if self.fixed_max else ""
        return self.tile.module(self.head_dim, self.kind) + self.feature_suffix + fixed

    @property
    def source(self) -> Source:
        return Source.of(cc.TEMPLATE, self.tile.params(self.head_dim, self.kind, self.window, self.softcap, self.sinks,
                                                       self.alibi, self.varlen, self.fixed_max, self.kv_cache,
                                                       self.page_rows), self.module)

    def describe(self) -> str:
        return super().describe() + (" fixed max" if self.fixed_max else "")


def run_kernel(kernel, tile: variants.Sm90FwdTile, q, k, v, out, lse, scale_log2: float, *, causal: bool,
               descale=None, ctas: int | None = None, plan: tail_split.Plan | None = None,
               scores: tuple = ()) -> tail_split.Plan | None:
    """Call a compiled kernel of ``tile`` with the arguments its signature takes: ``v`` as the kernel reads it
    (FP8: prepare_v_fp8's V^T), ``descale`` (3, batch, heads_kv) for FP8; ``ctas`` for a persistent kernel
    (default: the SM count). With ``tile.tail_split`` and no causal mask, ``plan`` (default:
    tail_split.plan for this shape) says which tiles run as pieces; their combine runs after the kernel.
    ``scores``: the trailing arguments of a packed (VARLEN) kernel (offsets and tile table) and of a score-feature
    kernel (score_arguments), in that order; such kernels run every tile whole. Returns the plan that ran (None: the kernel takes none)."""
    if ctas is None:
        ctas = max_ctas(q.device)
    if not tile.tail_split:  # (the launch path of every call: kept to one branch and the call)
        if descale is None:
            kernel(q, k, v, out, lse, scale_log2, ctas, *scores)
        else:
            kernel(q, k, v, out, lse, descale, scale_log2, ctas, *scores)
        return None
    causal = causal or bool(scores)  # (a softcap-only kernel could split; it runs whole, as a windowed one must)
    head = (q, k, v, out, lse) if descale is None else (q, k, v, out, lse, descale)
    b, h, n_q, d = q.shape
    tiles, key_blocks = tail_split.counts(tile, b, h, n_q, k.shape[2])
    if plan is None:
        plan = tail_split.whole(tiles) if causal else tail_split.plan(tiles, key_blocks, ctas)
    else:  # a given plan (tests, benchmarks): a wrong one would launch a wrong grid
        reasons = plan.check(tiles, key_blocks) + (["causal kernels run every tile whole"] if causal and plan.tail_tiles else [])
        if reasons:
            raise ValueError(f"tail split plan {plan} cannot run this call ({tiles} tiles of {key_blocks} key blocks): "
                             + "; ".join(reasons))
    o_part, lse_part = tail_split.workspaces(plan, tile.tile_m, d, q.device)
    kernel(*head, scale_log2, ctas, o_part, lse_part, plan.full_tiles, plan.pieces, *scores)
    if plan.tail_tiles:
        tail_split.combine(plan, o_part, lse_part, out, lse, tile.tile_m)
    return plan


def score_descale(descale: torch.Tensor, scale_log2: float) -> tuple[torch.Tensor, float]:
    """(descale, scale_log2) for the FP8 kernel, which scales the scores by scale_log2 * q_descale * k_descale
    (templates/cute_sm90_fwd.py.jinja, consume_tile) after masking them to -inf: a product of 0 (a zero
    descale or scale) made NaN of every masked score (-inf * 0) and of the first row max. Here the product is
    taken on the device, into q's row (k's row becomes 1, scale_log2 1), and raised to TINY_SCALE where it is
    smaller in magnitude: e4m3 scores (|q.k| <= 448^2 * 256 < 2^26) times it are below 2^-74, so P is what
    the exact 0 gives in fp32 (uniform over the visible keys) and the LSE log(visible keys), exactly as
    attention of descale * x. A NaN descale stays NaN. No device sync: a few element-wise ops on (batch,
    heads_kv); the descales the backward dequantises with are not changed."""
    qk = descale[0] * descale[1] * scale_log2
    qk = torch.where(qk.abs() < TINY_SCALE, TINY_SCALE, qk)
    return torch.stack((qk, torch.ones_like(qk), descale[2])), 1.0


class CuteSm90Backend(Backend):
    name = "cute_sm90"
    summary = ("FA3-style TMA + WGMMA forward and backward in the CuTe DSL (templates/cute_sm90_fwd.py.jinja, "
               "cute_sm90_bwd.py.jinja)")
    support = Support(
        vendors=frozenset({"nvidia"}),
        archs=frozenset({"sm90"}),
        dtypes=frozenset(cc.DTYPES),  # fp8 = e4m3 in (with descales), bf16 out
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,  # no Philox mask in the kernel; sdpa serves dropout
        empty=False,  # zero-sized grids; reference serves empty problems
        window=True,  # WINDOW forward and backward kernels (16-bit; not the deterministic backward: _plan_backward)
        softcap=True,  # SOFTCAP forward and backward kernels (16-bit)
        sinks=True,  # SINKS forward kernels (16-bit); the backward needs nothing (P from the LSE, which counts it)
        alibi=True,  # ALIBI forward and backward kernels (16-bit)
        varlen=True,  # VARLEN forward kernels (16-bit); the backward's: bwd_variants.PACKED (_plan_backward)
        # KV_CACHE forward kernels (16-bit; paged: page sizes variants.page_rows takes); automatic dispatch passes
        # decode-shaped calls over (passed_over), and every call while variants.KV_CACHE_AUTO is off
        kv_cache=frozenset({"contiguous", "paged"}),
        nondeterministic_backward="dQ is summed by TMA reduce-add in the order the CTAs reach it",
        deterministic_backward="dQ summed in key-block order",
    )

    def available(self) -> list[str]:
        return stack_missing()

    def _plan(self, problem: Problem) -> Planned:
        reasons = []
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        kind = cc.KIND[problem.dtype]
        features = problem_features(problem)
        if kind != "16bit" and any(features.values()):
            reasons.append(f"its {problem.dtype} kernel has no sliding window, softcap, sinks or ALiBi (the 16-bit ones do)")
        if kind != "16bit" and problem.varlen:
            reasons.append(f"its {problem.dtype} kernel takes no packed (varlen) batch (the 16-bit ones do)")
        tile, why = variants.pick(kind, problem.head_dim)
        reasons += why
        rows = 0
        if tile is not None and problem.kv_cache:
            rows, pages_why = (variants.page_rows(tile.tile_n, problem.kv_page_size) if problem.kv_cache == "paged"
                               else (0, []))
            reasons += pages_why or variants.kv_cache_reasons(tile, problem.kv_cache, rows, kind, problem.varlen)
        if reasons:
            return None, reasons
        fixed_max = variants.fixed_max_serves(problem)
        if fixed_max:
            tile = variants.fixed_max_tile(tile, problem.head_dim)
        return Sm90Variant(tile, kind, problem.head_dim, problem.dtype, problem.causal, **features,
                           varlen=problem.varlen, fixed_max=fixed_max, kv_cache=problem.kv_cache, page_rows=rows), []

    def _plan_backward(self, problem: Problem) -> Planned:
        reasons = []
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        if cc.KIND[problem.dtype] != "16bit":
            reasons.append(f"the backward takes fp16 or bf16, not {problem.dtype}")
        if problem.mask.windowed and problem.deterministic:
            reasons.append("its deterministic backward has no sliding window (the default one has)")
        if (problem.softcap or problem.alibi) and problem.deterministic:  # (compiled together, not yet run on a GPU)
            reasons.append("its deterministic backward has no softcap or ALiBi (the default one has)")
        if problem.varlen and not bwd_variants.PACKED:
            reasons.append(bwd_variants.PACKED_REASON)
        elif problem.varlen and problem.deterministic:
            reasons.append("its deterministic backward takes no packed (varlen) batch (the default one does)")
        tile, why = bwd_variants.pick(problem.head_dim, masked=problem.mask.by_rule)
        reasons += why
        if tile is not None:
            features = (problem.mask.windowed, problem.varlen, bool(problem.softcap), problem.alibi)
            tile = bwd_variants.staging_for(tile, *features)
            reasons += bwd_variants.feature_reasons(tile, *features)
        if reasons:
            return None, reasons
        return bwd.Sm90BwdVariant(tile, problem.head_dim, problem.dtype, problem.causal, problem.deterministic,
                                  problem.mask.windowed, problem.varlen, bool(problem.softcap), problem.alibi), []

    def passed_over_backward(self, problem: Problem) -> list[str]:
        """Automatic dispatch passes this backward over only where the arch's cost table measures the problem's
        class without its pairing (see bwd_variants.PLAN); a packed batch, which tables do not time, is judged by
        the dense batch of the same sequence count and longest lengths."""
        table = cost_model.table(problem.device.arch)
        if table is None:
            return []
        dense = dataclasses.replace(problem, varlen=False) if problem.varlen else problem
        if (table.estimate(bwd_variants.PLAN, dense, "fwd+bwd") is None
                and table.estimate(bwd_variants.FALLBACK_PLAN, dense, "fwd+bwd") is not None):
            return [bwd_variants.NOT_AUTO_BECAUSE]
        return []

    def passed_over(self, problem: Problem) -> list[str]:
        if problem.kv_cache:
            return self._kv_cache_passed_over(problem)
        lo, hi, measured = variants.TRITON_FASTER.get((cc.KIND[problem.dtype], problem.head_dim), (0, 0, ""))
        if not lo <= problem.seqlen_k < hi:
            return []
        triton = registered().get("triton_fa2")
        if triton is None or triton.available() or triton.supports(problem):
            return []  # nothing faster can take it: keep it
        return [f"triton_fa2 measured faster at head_dim {problem.head_dim} with {lo} <= seqlen_k < {hi} "
                f"({measured}; see backends/cute_sm90/variants.py)"]

    def _kv_cache_passed_over(self, problem: Problem) -> list[str]:
        """A KV-cache call goes to triton_fa2's split-KV kernel, where that can take it, while KV_CACHE_AUTO is off,
        and for a decode-shaped call: fewer queries than the tile's rows leave most of each tile idle, and the tile
        splits no keys across CTAs (triton_fa2's kernel packs each KV head's query heads into one tile and does)."""
        triton = registered().get("triton_fa2")
        if triton is None or triton.available() or triton.supports(problem):
            return []  # nothing else fast can take it: keep it
        reasons = [] if variants.KV_CACHE_AUTO else [variants.KV_CACHE_NOT_AUTO]
        tile, _ = variants.pick(cc.KIND[problem.dtype], problem.head_dim)
        if tile is not None and problem.seqlen_q < tile.tile_m:
            reasons.append(f"seqlen_q {problem.seqlen_q} < its tile's {tile.tile_m} query rows: triton_fa2's split-KV "
                           "kernel serves decode-shaped calls (each KV head's query heads in one tile, keys split "
                           "across CTAs)")
        return reasons

    def variants(self, archs=None, dtypes=None, head_dims=None, causal=(False, True), strict=False,
                 deterministic=False, features=()) -> list[Sm90Variant]:
        if archs is not None and "sm90" not in archs:
            return []
        out = []
        for dtype in dtypes or cc.DTYPES:
            if dtype not in cc.DTYPES:
                if strict:
                    raise ValueError(f"cute_sm90 builds {', '.join(cc.DTYPES)}, not {dtype!r}")
                continue
            for head_dim in head_dims or variants.HEAD_DIMS_OF[cc.KIND[dtype]]:
                tile, why = variants.pick(cc.KIND[dtype], head_dim)
                if tile is None:
                    if strict:
                        raise ValueError("cute_sm90: " + "; ".join(why))  # the reason already says "head_dim N"
                    continue
                out += [Sm90Variant(tile, cc.KIND[dtype], head_dim, dtype, flag) for flag in causal]
                if cc.KIND[dtype] == "16bit":  # the feature sets it compiles in (build --features; not FP8)
                    # (a softcap without ALiBi in bf16 builds both softmaxes: caps up to SMALL_SOFTCAP take the
                    # fixed max, larger ones the running one)
                    out += [Sm90Variant(variants.fixed_max_tile(tile, head_dim) if fixed else tile, "16bit", head_dim,
                                        dtype, flag, **feature_flags(kinds), varlen="varlen" in kinds, fixed_max=fixed)
                            for kinds in features if kinds and kinds <= {*SCORE_FEATURES, "varlen"}
                            for fixed in (False, True)
                            if not fixed or variants.fixed_max_kernel(dtype, "softcap" in kinds, "alibi" in kinds)
                            for flag in causal]
                if cc.KIND[dtype] == "16bit":
                    out += self._backward_variants(head_dim, dtype, causal, deterministic, features)
        return out

    @staticmethod
    def _backward_variants(head_dim: int, dtype: str, causal, deterministic: bool, features) -> list:
        """The backward kernels the planner can pick for a 16-bit ``head_dim``: each mask's table tile (a causal
        mask or a window may take another tile than none), plain and, with ``deterministic``, reproducible; and
        for build --features window / softcap / varlen / window+varlen...: the backwards of those feature sets too
        (sinks need no backward kernel of their own)."""
        out = []
        for det in ((False, True) if deterministic else (False,)):
            for flag in causal:
                back, _ = bwd_variants.pick(head_dim, masked=flag)
                if back is not None:
                    out.append(bwd.Sm90BwdVariant(back, head_dim, dtype, flag, det))
        kernel_kinds = {"window", "softcap", "alibi", "varlen"}
        for kinds in sorted({frozenset(kinds & kernel_kinds) for kinds in features
                             if kinds & kernel_kinds and ("varlen" not in kinds or bwd_variants.PACKED)}, key=sorted):
            flags = {kind: kind in kinds for kind in ("window", "varlen", "softcap", "alibi")}
            for flag in causal:
                back, _ = bwd_variants.pick(head_dim, masked=flag or flags["window"])
                back = back and bwd_variants.staging_for(back, **flags)
                if back is not None and not bwd_variants.feature_reasons(back, **flags):
                    out.append(bwd.Sm90BwdVariant(back, head_dim, dtype, flag, False, **flags))
        return out

    def builds(self, variant: Sm90Variant | bwd.Sm90BwdVariant) -> list:
        if isinstance(variant, bwd.Sm90BwdVariant):  # with the Triton kernels before and after it
            return [variant.build, *bwd.aot_builds(variant.dtype, variant.head_dim)]
        return [variant.build] + ([aot_build("sm90")] if variant.dtype == "fp8" else [])  # FP8's V^T kernel (Triton)

    def forward(self, variant: Sm90Variant, call):
        q, scale = nonnegative_scale(call.q, call.scale)
        q, k = tma_ready(q), tma_ready(call.k)
        lse = lse_like(q.shape[:3], q.device)
        scores, scale_log2 = trailing_arguments(variant, call, scale)
        if variant.dtype == "fp8":
            out = torch.empty_like(q, dtype=torch.bfloat16)
            descale = call.descale
            if descale is None:
                descale = torch.ones(3, k.shape[0], k.shape[1], dtype=torch.float32, device=q.device)
            descale, scale_log2 = score_descale(descale, scale_log2)
            run_kernel(variant.kernel, variant.tile, q, k, prepare_v_fp8(call.v), out, lse, scale_log2,
                       causal=variant.causal, descale=descale)
        else:
            out = torch.empty_like(q)  # q's strides when q is dense, else contiguous: TMA-ready either way
            run_kernel(variant.kernel, variant.tile, q, k, tma_ready(call.v), out, lse, scale_log2, causal=variant.causal,
                       scores=scores)
        return out, lse

    def backward(self, variant: bwd.Sm90BwdVariant, call, out, lse, dout, dlse=None):
        return bwd.run(variant, call.q, call.k, call.v, out, lse, dout, call.scale, dlse, scores=call,
                       packed=call.varlen if variant.varlen else None)

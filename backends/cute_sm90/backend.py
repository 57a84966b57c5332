"""FlashAttention-3-style forward for Hopper (sm90) in the CuTe DSL: TMA, WGMMA, warp specialization.

Kernels are rendered from templates/cute_sm90_fwd.py.jinja into _generated/, one per variant of
variants.py; compile.py compiles them (once per machine, cached on disk) and calls them through TVM
FFI. Forward only: the backward is triton_fa2's, from this forward's output and LSE, and the
Decision shows that choice.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ...dispatch.problem import Problem
from ...dispatch.registry import Backend
from ...dispatch.support import Support
from ..inputs import nonnegative_scale
from . import compile as cc
from . import tail_split, variants
from .v_layout import prepare_v_fp8


_DTYPE_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
LOG2_E = 1.4426950408889634  # the kernels work in exp2: they take scale * log2(e)


@functools.lru_cache(maxsize=None)
def max_ctas(device: torch.device) -> int:
    """The CTA count a persistent cute_sm90 kernel launches on ``device``: its SM count (one CTA fits per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs unit stride on head_dim, 16-byte aligned other strides and a 16-byte aligned start.
    (Every head_dim served is a multiple of 16 bytes, so a fresh contiguous copy qualifies.)"""
    if t.data_ptr() % 16 == 0 and (t.is_contiguous() or (
            t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def run_kernel(kernel, tile: variants.Sm90FwdTile, q, k, v, out, lse, scale_log2: float, *, causal: bool,
               descale=None, ctas: int | None = None, plan: tail_split.Plan | None = None) -> tail_split.Plan | None:
    """Call a compiled kernel of ``tile`` with the arguments its signature takes: ``v`` as the kernel reads it
    (FP8: prepare_v_fp8's V^T), ``descale`` (3, batch, heads_kv) for FP8; ``ctas`` for a persistent kernel
    (default: the SM count). With ``tile.tail_split`` and no causal mask, ``plan`` (default:
    tail_split.plan for this shape) says which tiles run as pieces; their combine runs after the kernel.
    Returns the plan that ran (None: the kernel takes none)."""
    if ctas is None:
        ctas = max_ctas(q.device)
    if not tile.tail_split:  # (the launch path of every call: kept to one branch and the call)
        if descale is None:
            kernel(q, k, v, out, lse, scale_log2, ctas)
        else:
            kernel(q, k, v, out, lse, descale, scale_log2, ctas)
        return None
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
    kernel(*head, scale_log2, ctas, o_part, lse_part, plan.full_tiles, plan.pieces)
    if plan.tail_tiles:
        tail_split.combine(plan, o_part, lse_part, out, lse, tile.tile_m)
    return plan


@functools.lru_cache(maxsize=256)
def _lse_prototype(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """One fp32 element expanded to the LSE's shape: torch.empty_like() of it allocates a contiguous LSE
    in about a third of torch.empty(shape, ...)'s time (no shape and device parsing; ~1 vs ~2.8 us on CPU)."""
    return torch.empty(1, dtype=torch.float32, device=device).expand(shape)


def cute_stack_missing() -> list[str]:
    """The reason the CuTe-DSL backends cannot run in this process, if a package they need is missing."""
    missing = [pkg for mod, pkg in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"))
               if importlib.util.find_spec(mod) is None]
    return [f"{', '.join(missing)} not installed (pip install 'attnforge[cute]')"] if missing else []


class CuteSm90Backend(Backend):
    name = "cute_sm90"
    summary = "FA3-style TMA + WGMMA forward in the CuTe DSL (templates/cute_sm90_fwd.py.jinja)"
    support = Support(
        vendors=frozenset({"nvidia"}),
        archs=frozenset({"sm90"}),
        dtypes=frozenset({"fp16", "bf16", "fp8"}),  # fp8 = e4m3 in (with descales), bf16 out
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,  # no Philox mask in the kernel; sdpa serves dropout
        backward=False,  # triton_fa2's backward runs from this forward's LSE
        empty=False,  # zero-sized grids; reference serves empty problems
    )

    def available(self) -> list[str]:
        return cute_stack_missing()

    @staticmethod
    def _kind(problem: Problem) -> str:
        return cc.KIND.get(problem.dtype, "16bit")

    def supports(self, problem: Problem) -> list[str]:
        reasons = self.support.reasons(problem)
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        if problem.head_dim not in variants.HEAD_DIMS:
            if problem.head_dim <= max(variants.HEAD_DIMS):  # larger ones already have their reason
                reasons.append(f"head_dim {problem.head_dim} has no cute_sm90 kernel "
                               f"(has {', '.join(map(str, variants.HEAD_DIMS))})")
        else:
            reasons += variants.pick(self._kind(problem), problem.head_dim)[1]
        return reasons

    def passed_over(self, problem: Problem) -> list[str]:
        lo, hi, measured = variants.TRITON_FASTER.get((self._kind(problem), problem.head_dim), (0, 0, ""))
        if not lo <= problem.seqlen_k < hi:
            return []
        from ...dispatch.registry import registered

        triton = registered().get("triton_fa2")
        if triton is None or triton.available() or triton.supports(problem):
            return []  # nothing faster can take it: keep it
        return [f"triton_fa2 measured faster at head_dim {problem.head_dim} with {lo} <= seqlen_k < {hi} "
                f"({measured}; see backends/cute_sm90/variants.py)"]

    def variant(self, problem: Problem) -> str:
        tile, _ = variants.pick(self._kind(problem), problem.head_dim)
        return f"fwd {tile.describe()}" if tile else ""

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def tile(dtype: torch.dtype, head_dim: int) -> variants.Sm90FwdTile:
        """The picked variant (cached: forward() runs on every call)."""
        tile, reasons = variants.pick(cc.KIND[_DTYPE_NAME[dtype]], head_dim)
        if tile is None:  # supports() said so first; this guards direct calls
            raise RuntimeError("; ".join(reasons))
        return tile

    @staticmethod
    def module(dtype: torch.dtype, head_dim: int) -> str:
        """The generated module of the picked variant."""
        return CuteSm90Backend.picked(dtype, head_dim)[1]

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def picked(dtype: torch.dtype, head_dim: int) -> tuple[variants.Sm90FwdTile, str]:
        """(tile, generated module) of the picked variant: one cached lookup on every forward() call."""
        tile = CuteSm90Backend.tile(dtype, head_dim)
        return tile, tile.module(head_dim, cc.KIND[_DTYPE_NAME[dtype]])

    def forward(self, q, k, v, *, causal, scale, dropout_p, descale=None, **mask):
        q, scale = nonnegative_scale(q, scale)
        q, k = _tma_ready(q), _tma_ready(k)
        dtype = _DTYPE_NAME[q.dtype]
        tile, module = self.picked(q.dtype, q.shape[-1])
        kernel = cc.compiled(module, dtype, causal)
        lse = torch.empty_like(_lse_prototype(q.shape[:3], q.device))
        scale_log2 = scale * LOG2_E
        if dtype == "fp8":
            out = torch.empty_like(q, dtype=torch.bfloat16)
            if descale is None:
                descale = torch.ones(3, k.shape[0], k.shape[1], dtype=torch.float32, device=q.device)
            run_kernel(kernel, tile, q, k, prepare_v_fp8(v), out, lse, scale_log2, causal=causal, descale=descale)
        else:
            out = torch.empty_like(q)  # q's strides when q is dense, else contiguous: TMA-ready either way
            run_kernel(kernel, tile, q, k, _tma_ready(v), out, lse, scale_log2, causal=causal)
        return out, lse

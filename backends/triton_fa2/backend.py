"""FA2-style Triton attention for NVIDIA (sm80+), forward and backward, from generated kernels.

Tiles come from variants.py per arch and head dim; the kernel modules are rendered from
templates/triton_fa2_{fwd,bwd}.py.jinja into _generated/. With TRITON_INTERPRET=1 the same kernels
run on CPU tensors in Triton's interpreter (tests and debugging), using the sm80 tiles.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from ...dispatch.device import detect
from ...dispatch.problem import Problem
from ...dispatch.registry import Backend
from ...dispatch.support import Support
from . import variants

INTERPRETER_ARCH = "sm80"  # tiles used when the interpreter runs the kernels on the CPU


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _arch(spec) -> str:
    return INTERPRETER_ARCH if spec.vendor == "cpu" else spec.arch


@functools.lru_cache(maxsize=None)
def _module(family: str, arch: str, head_dim: int):
    table = variants.FWD if family == "fwd" else variants.BWD
    tile, reasons = variants.pick(table, arch, head_dim)
    if tile is None:  # supports() said so first; this is a guard for direct calls
        raise RuntimeError("; ".join(reasons))
    return importlib.import_module(f"{__package__}._generated.{tile.module}")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with stride 1 (and TMA requires it); other strides are taken as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonFA2Backend(Backend):
    name = "triton_fa2"
    summary = "FA2-style Triton kernels rendered from templates/triton_fa2_*.py.jinja"
    support = Support(
        vendors=frozenset({"nvidia", "cpu"}),
        archs=frozenset(variants.FWD) | {"cpu"},
        dtypes=frozenset({"fp16", "bf16"}),
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,  # not implemented (no Philox mask yet); sdpa serves dropout
        empty=False,  # zero-sized grids; reference serves empty problems
    )

    def available(self) -> list[str]:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return [f"triton is not importable ({exc})"]
        return []

    def _reasons(self, problem: Problem, table) -> list[str]:
        reasons = []
        if problem.device.vendor == "cpu" and not interpreting():
            reasons.append("runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        if problem.device.vendor in self.support.vendors and problem.head_dim <= max(variants.HEAD_DIMS):
            reasons += variants.pick(table, _arch(problem.device), problem.head_dim)[1]
        return reasons

    def supports(self, problem: Problem) -> list[str]:
        return self.support.reasons(problem) + self._reasons(problem, variants.FWD)

    def supports_backward(self, problem: Problem) -> list[str]:
        return self.support.backward_reasons(problem) + self._reasons(problem, variants.BWD)

    def variant(self, problem: Problem) -> str:
        arch = _arch(problem.device)
        fwd, _ = variants.pick(variants.FWD, arch, problem.head_dim)
        bwd, _ = variants.pick(variants.BWD, arch, problem.head_dim)
        parts = [t.describe() + (" (tuned)" if t == variants.tuned_tile(family, arch, problem.head_dim) else "")
                 for family, t in (("fwd", fwd), ("bwd", bwd)) if t is not None]
        return "; ".join(parts) + (" (interpreter)" if problem.device.vendor == "cpu" else "")

    def forward(self, q, k, v, *, causal, scale, dropout_p):
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        module = _module("fwd", _arch(detect(q.device)), q.shape[-1])
        out = torch.empty_like(q)  # same strides as q when q is dense (bshd stays bshd), else contiguous
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        module.launch(q, k, v, out, lse, causal=causal, scale=scale)
        return out, lse

    def backward(self, q, k, v, out, lse, dout, *, causal, scale):
        q, k, v, dout = _unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(dout)
        module = _module("bwd", _arch(detect(q.device)), q.shape[-1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        module.launch(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale)
        return dq, dk, dv

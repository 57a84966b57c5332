"""FA2-style Triton attention for NVIDIA (sm80+), forward and backward, from generated kernels.

Tiles come from variants.py per arch and head dim; the kernel modules are rendered from
templates/triton_fa2_{fwd,bwd}.py.jinja into _generated/. With TRITON_INTERPRET=1 the same kernels
run on CPU tensors in Triton's interpreter (tests and debugging), using the sm80 tiles.
"""

from __future__ import annotations

import importlib
import os

import torch

from ...dispatch.device import detect
from ...dispatch.problem import Problem
from ...dispatch.registry import Backend
from ...dispatch.support import Support
from . import variants

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with stride 1 (and TMA requires it); other strides are taken as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonFA2Backend(Backend):
    """Also the base of triton_rocm: a subclass swaps the variant tables, the generated package and
    the arch whose tiles the interpreter uses; the kernels' math is the same."""

    name = "triton_fa2"
    summary = "FA2-style Triton kernels rendered from templates/triton_fa2_*.py.jinja"
    variants = variants
    generated = f"{__package__}._generated"
    interpreter_arch = "sm80"  # tiles used when the interpreter runs the kernels on the CPU
    support = Support(
        vendors=frozenset({"nvidia", "cpu"}),
        archs=frozenset(variants.FWD) | {"cpu"},
        dtypes=frozenset({"fp16", "bf16"}),
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,  # not implemented (no Philox mask yet); sdpa serves dropout
        empty=False,  # zero-sized grids; reference serves empty problems
    )

    def __init__(self):
        self._modules: dict[tuple, object] = {}

    def _arch(self, spec) -> str:
        return self.interpreter_arch if spec.vendor == "cpu" else spec.arch

    def _pick(self, family: str, arch: str, head_dim: int):
        table = self.variants.FWD if family == "fwd" else self.variants.BWD
        return variants.pick(table, arch, head_dim, backend=self.name)

    def module(self, family: str, arch: str, head_dim: int):
        """The generated kernel module for (family, arch, head_dim), imported once per process."""
        key = (family, arch, head_dim)
        if key not in self._modules:
            tile, reasons = self._pick(family, arch, head_dim)
            if tile is None:  # supports() said so first; this guards direct calls
                raise RuntimeError("; ".join(reasons))
            self._modules[key] = importlib.import_module(f"{self.generated}.{tile.module}")
        return self._modules[key]

    def forget_modules(self) -> None:
        self._modules.clear()

    def available(self) -> list[str]:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return [f"triton is not importable ({exc})"]
        return []

    def _reasons(self, problem: Problem, family: str) -> list[str]:
        reasons = []
        if problem.device.vendor == "cpu" and not interpreting():
            reasons.append("runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        arch = self._arch(problem.device)
        if arch in self.variants.FWD and problem.head_dim <= max(variants.HEAD_DIMS):
            reasons += self._pick(family, arch, problem.head_dim)[1]
        return reasons

    def supports(self, problem: Problem) -> list[str]:
        return self.support.reasons(problem) + self._reasons(problem, "fwd")

    def supports_backward(self, problem: Problem) -> list[str]:
        return self.support.backward_reasons(problem) + self._reasons(problem, "bwd")

    def variant(self, problem: Problem) -> str:
        arch = self._arch(problem.device)
        fwd, _ = self._pick("fwd", arch, problem.head_dim)
        bwd, _ = self._pick("bwd", arch, problem.head_dim)
        parts = [t.describe() + (" (tuned)" if t == variants.tuned_tile(family, arch, problem.head_dim) else "")
                 for family, t in (("fwd", fwd), ("bwd", bwd)) if t is not None]
        return "; ".join(parts) + (" (interpreter)" if problem.device.vendor == "cpu" else "")

    def forward(self, q, k, v, *, causal, scale, dropout_p, **mask):
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        module = self.module("fwd", self._arch(detect(q.device)), q.shape[-1])
        out = torch.empty_like(q)  # same strides as q when q is dense (bshd stays bshd), else contiguous
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        module.launch(q, k, v, out, lse, causal=causal, scale=scale)
        return out, lse

    def backward(self, q, k, v, out, lse, dout, *, causal, scale):
        q, k, v, dout = _unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(dout)
        module = self.module("bwd", self._arch(detect(q.device)), q.shape[-1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        module.launch(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale)
        return dq, dk, dv

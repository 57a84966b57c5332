"""The host side of cute_sm90's backward (templates/cute_sm90_bwd.py.jinja): its Variant, the fake arguments it
is compiled against, and the call: delta = rowsum(dO * O) and the LSE in log2 units (both padded to whole
query blocks) before the kernel, the fp32 dQ accumulator scaled and converted after it."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...codegen import Source
from ...runtime import cute
from ..shared.cute_host import LOG2_E, CuteVariant, elements, tma_ready
from . import compile as cc
from . import bwd_variants

TEMPLATE = "cute_sm90_bwd.py.jinja"
FACTORY = f"{__name__}:compile_arguments"  # what runtime.cute calls to trace a backward kernel


@dataclasses.dataclass(frozen=True)
class Sm90BwdVariant(CuteVariant):
    """One compiled cute_sm90 backward: a backward tile of the table for a head dim, dtype and causality."""

    tile: bwd_variants.Sm90BwdTile
    head_dim: int
    dtype: str
    causal: bool
    compile_module = cc

    @property
    def module(self) -> str:
        return self.tile.module(self.head_dim)

    @property
    def source(self) -> Source:
        return Source.of(TEMPLATE, self.tile.params(self.head_dim), self.module)

    factory = FACTORY

    def describe(self) -> str:
        return f"bwd {self.tile.describe()}"


def fake_arguments(dtype: str, head_dim: int, arch: str):
    """Fake arguments for cute.compile, in __call__'s order: q, k, v, dout (batch, heads, seqlen, head_dim) with
    symbolic sizes and 16-byte aligned strides, the LSE (log2) and delta (batch, heads, seqlen_q padded), the
    fp32 dQ accumulator (batch, heads, seqlen_q, head_dim), dk, dv, scale_log2, scale and the stream."""
    cutlass = cute.import_cutlass(arch)
    import cutlass.cute as cute_dsl
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    element, _ = elements(dtype, arch)
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, padded_q = (cute_dsl.sym_int32() for _ in range(6))

    def tensor(elem, *shape):
        strides = [cute_dsl.sym_int64(divisibility=16 // (elem.width // 8)) for _ in range(3)]
        return make_fake_tensor(elem, shape, (*strides, 1), assumed_align=16)

    def rows():  # (batch, heads, padded seqlen_q) fp32, TMA-ready (padded to whole blocks of 64 rows)
        return make_fake_tensor(cutlass.Float32, (batch, heads_q, padded_q),
                                (cute_dsl.sym_int64(divisibility=4), cute_dsl.sym_int64(divisibility=4), 1),
                                assumed_align=16)

    q, dout = tensor(element, batch, heads_q, seqlen_q, head_dim), tensor(element, batch, heads_q, seqlen_q, head_dim)
    k, v = tensor(element, batch, heads_kv, seqlen_k, head_dim), tensor(element, batch, heads_kv, seqlen_k, head_dim)
    dk, dv = tensor(element, batch, heads_kv, seqlen_k, head_dim), tensor(element, batch, heads_kv, seqlen_k, head_dim)
    dq_accum = tensor(cutlass.Float32, batch, heads_q, seqlen_q, head_dim)
    return (q, k, v, dout, rows(), rows(), dq_accum, dk, dv, cutlass.Float32(1.0), cutlass.Float32(1.0),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_arguments(module, dtype: str, causal: bool, arch: str):
    """runtime.cute's factory for the backward modules: the module's Backward and its fake arguments."""
    element, _ = elements(dtype, arch)
    return module.Backward(element, causal), fake_arguments(dtype, module.INPUT_HEAD_DIM, arch)


def row_statistics(out, dout, lse, dlse, tile_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(LSE * log2(e), delta = rowsum(dO * O) - dLSE), fp32 (batch, heads, seqlen_q rounded up to ``tile_m``): what
    the kernel's TMA loads a query block of. A row that saw no key (LSE -inf) gets +inf, so that its P is 0; padding
    rows get +inf and 0 (their Q and dO load as zeros)."""
    b, h, n = lse.shape
    padded = math.ceil(max(n, 1) / tile_m) * tile_m
    lse2 = torch.full((b, h, padded), math.inf, dtype=torch.float32, device=lse.device)
    lse2[..., :n] = torch.where(lse == -math.inf, math.inf, lse * LOG2_E)
    delta = torch.zeros((b, h, padded), dtype=torch.float32, device=lse.device)
    torch.sum(dout.float() * out.float(), dim=-1, out=delta[..., :n])
    if dlse is not None:
        delta[..., :n] -= dlse.float()
    return lse2, delta


def run(variant: Sm90BwdVariant, q, k, v, out, lse, dout, scale: float, dlse=None, dk=None, dv=None):
    """(dq, dk, dv) by ``variant``'s kernel from the forward's output and natural-log LSE (``dk``, ``dv``: where to
    write those, TMA-ready like k; default new tensors). The fp32 dQ accumulator (4 bytes per element of q) is the
    workspace this adds to the inputs' size."""
    q, k, v, dout = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(dout)
    lse2, delta = row_statistics(out, dout, lse, dlse, variant.tile.tile_m)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    variant.kernel(q, k, v, dout, lse2, delta, dq_accum, dk, dv, scale * LOG2_E, scale)
    return (dq_accum * scale).to(q.dtype), dk, dv

"""The host side of cute_sm90's backward (templates/cute_sm90_bwd.py.jinja): its Variant, the fake arguments it
is compiled against, and the call: delta = rowsum(dO * O) and the LSE in log2 units (both padded to whole
query blocks) before the kernel, the fp32 dQ accumulator scaled and converted after it."""

from __future__ import annotations

import dataclasses
import math
import typing

import torch

from ...codegen import Source
from ...dispatch.problem import dtype_name
from ...runtime import cute
from ...runtime.triton_launch import launch, next_power_of_2
from ..shared.cute_host import (LOG2_E, CuteVariant, elements, fake_packed, fake_scores, max_ctas, score_arguments,
                                tma_ready)
from ..shared.cute_varlen import key_tables, packed_rows
from ..shared.inputs import nonnegative_scale
from . import compile as cc
from . import bwd_variants

TEMPLATE = "cute_sm90_bwd.py.jinja"
FACTORY = f"{__name__}:compile_arguments"  # what runtime.cute calls to trace a backward kernel


@dataclasses.dataclass(frozen=True)
class Sm90BwdVariant(CuteVariant):
    """One compiled cute_sm90 backward: a backward tile of the table for a head dim, dtype and causality;
    ``deterministic``: its dQ reduce-adds ordered by key block (bitwise reproducible); ``window``: the template's
    WINDOW (the window itself is the call's); ``softcap``, ``alibi``: its SOFTCAP and ALIBI (the cap and slopes are
    the call's); ``varlen``: its VARLEN (a packed batch). Sinks need nothing of the kernel: P comes from the
    forward's LSE, which counts the sink, and dsinks from the output and LSE."""

    tile: bwd_variants.Sm90BwdTile
    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool = False
    window: bool = False
    varlen: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: typing.ClassVar[bool] = False  # (no kernel of its own: see above)
    compile_module = cc

    @property
    def module(self) -> str:
        return self.tile.module(self.head_dim) + ("_det" if self.deterministic else "") + self.feature_suffix

    @property
    def source(self) -> Source:
        return Source.of(TEMPLATE, {**self.tile.params(self.head_dim), "deterministic": self.deterministic,
                                    "window": self.window, "softcap": self.softcap, "alibi": self.alibi,
                                    "varlen": self.varlen}, self.module)

    factory = FACTORY

    def describe(self) -> str:
        return (f"bwd {self.tile.describe()}" + (", dQ summed in key-block order" if self.deterministic else "")
                + self.feature_note)


def fake_arguments(dtype: str, head_dim: int, arch: str, window: bool = False, varlen: bool = False,
                   softcap: bool = False, alibi: bool = False, accumulator_head_dim: int | None = None,
                   persistent: bool = False):
    """Fake arguments for cute.compile, in __call__'s order: q, k, v, dout (batch, heads, seqlen, head_dim) with
    symbolic sizes and 16-byte aligned strides, the LSE (log2) and delta (batch, heads, seqlen_q padded), the
    fp32 dQ accumulator (batch, heads, seqlen_q, head_dim; with ``accumulator_head_dim``, a FLAT_DQ kernel's: whole
    query blocks, padded like the LSE, at that head dim, FlatDqOrder), the int32 dQ order counts (batch, heads, query
    blocks; read by the deterministic kernels only, the first a persistent kernel's tile counter), dk, dv, scale_log2,
    scale, with ``persistent`` the Int32 CTA count (the SM count), with ``window`` the Int32 window bounds (left,
    right), with ``softcap`` the Float32 pre-tanh scale, with ``alibi`` the fp32 slopes (batch, or the sequences with
    ``varlen``; heads_q), with ``varlen`` the int32 offsets cu_seqlens_q and cu_seqlens_k (batch + 1,) and the key
    tile table (tiles, 2) (cute_varlen.key_tile_table), and the stream."""
    cutlass = cute.import_cutlass(arch)
    import cutlass.cute as cute_dsl
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    element, _ = elements(dtype, arch)
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, padded_q, q_blocks = (cute_dsl.sym_int32() for _ in range(7))

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
    if accumulator_head_dim is None:
        dq_accum = tensor(cutlass.Float32, batch, heads_q, seqlen_q, head_dim)
    else:  # FLAT_DQ: as many rows as the LSE's, padded to whole query blocks
        dq_accum = tensor(cutlass.Float32, batch, heads_q, padded_q, accumulator_head_dim)
    dq_order = make_fake_tensor(cutlass.Int32, (batch, heads_q, q_blocks),
                                (cute_dsl.sym_int64(), cute_dsl.sym_int64(), 1), assumed_align=4)
    bounds = fake_scores(batch, heads_q, window=window, softcap=softcap, alibi=alibi, varlen=varlen)
    packed = fake_packed() if varlen else ()
    ctas = (cutlass.Int32(1),) if persistent else ()
    return (q, k, v, dout, rows(), rows(), dq_accum, dq_order, dk, dv, cutlass.Float32(1.0), cutlass.Float32(1.0),
            *ctas, *bounds, *packed, make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_arguments(module, dtype: str, causal: bool, arch: str):
    """runtime.cute's factory for the backward modules: the module's Backward and its fake arguments."""
    element, _ = elements(dtype, arch)
    return module.Backward(element, causal), fake_arguments(dtype, module.INPUT_HEAD_DIM, arch,
                                                            window=getattr(module, "WINDOW", False),
                                                            varlen=getattr(module, "VARLEN", False),
                                                            softcap=getattr(module, "SOFTCAP", False),
                                                            alibi=getattr(module, "ALIBI", False),
                                                            accumulator_head_dim=module.HEAD_DIM if getattr(
                                                                module, "FLAT_DQ", False) else None,
                                                            persistent=getattr(module, "PERSISTENT", False))


def block_rows(seqlen_q: int, tile_m: int) -> int:
    """The rows of the LSE, delta and a FLAT_DQ accumulator: seqlen_q rounded up to whole query blocks (one block at
    least, so that an empty sequence still has a block for the kernel's loads)."""
    return math.ceil(max(seqlen_q, 1) / tile_m) * tile_m


def row_statistics(out, dout, lse, dlse, tile_m: int, use_triton: bool | None = None, dq_accum=None):
    """(LSE * log2(e), delta = rowsum(dO * O) - dLSE), fp32 (batch, heads, seqlen_q rounded up to ``tile_m``): what
    the kernel's TMA loads a query block of. A row that saw no key (LSE -inf) gets +inf, so that its P is 0; padding
    rows get +inf and 0 (their Q and dO load as zeros). ``dq_accum``, the kernel's fp32 dQ accumulator (contiguous,
    out's shape, or a FLAT_DQ kernel's: FlatDqOrder.accumulator's), is set to zero in the same pass. One Triton kernel on CUDA (bwd_rows_kernel.py; ``use_triton``
    forces it, e.g. in Triton's interpreter), torch elsewhere."""
    b, h, n = lse.shape
    padded = block_rows(n, tile_m)
    acc_width = 0  # (0: out's shape; else a FLAT_DQ accumulator's rows: padded, at the kernel's head dim)
    if dq_accum is not None:
        assert dq_accum.dtype == torch.float32 and dq_accum.is_contiguous()
        if dq_accum.shape != out.shape:
            assert dq_accum.shape[:3] == (b, h, padded), (dq_accum.shape, padded)
            acc_width = dq_accum.shape[-1]
    if not (out.is_cuda if use_triton is None else use_triton):
        if dq_accum is not None:
            dq_accum.zero_()
        return _row_statistics_torch(out, dout, lse, dlse, padded)
    from . import bwd_rows_kernel as k

    out, dout = tma_ready(out), tma_ready(dout)
    lse = lse.float().contiguous()
    lse2 = torch.empty((b, h, padded), dtype=torch.float32, device=lse.device)
    delta = torch.empty_like(lse2)
    dlse_arg = lse if dlse is None else dlse.float().contiguous()  # not read without dlse
    acc = lse2 if dq_accum is None else dq_accum  # not written without dq_accum
    if b * h:
        args = (out, dout, lse, dlse_arg, lse2, delta, acc, int(dlse is not None), int(dq_accum is not None), n,
                padded, h, *_units(out), *_units(dout))
        launch(k.row_statistics, (-(-padded // k.BLOCK_ROWS), b * h), args,
               {**_dims(out.shape[-1]), "ACC_WIDTH": acc_width}, k.NUM_WARPS,
               k.NUM_STAGES)
    return lse2, delta


def _row_statistics_torch(out, dout, lse, dlse, padded: int):
    b, h, n = lse.shape
    lse2 = torch.full((b, h, padded), math.inf, dtype=torch.float32, device=lse.device)
    lse2[..., :n] = torch.where(lse == -math.inf, math.inf, lse * LOG2_E)
    delta = torch.zeros((b, h, padded), dtype=torch.float32, device=lse.device)
    torch.sum(dout.float() * out.float(), dim=-1, out=delta[..., :n])
    if dlse is not None:
        delta[..., :n] -= dlse.float()
    return lse2, delta


def spread_rows(lse2: torch.Tensor, delta: torch.Tensor, index: torch.Tensor, rows: int):
    """A packed batch's row statistics (1, heads, total_q padded) moved to the packed backward's padded rows
    (cute_varlen.padded_rows: ``index`` per packed row, ``rows`` in all); the rows between sequences get +inf and 0,
    as padding rows do."""
    total = index.numel()
    spread_lse = lse2.new_full((*lse2.shape[:2], rows), math.inf)
    spread_delta = delta.new_zeros((*delta.shape[:2], rows))
    spread_lse[..., index] = lse2[..., :total]
    spread_delta[..., index] = delta[..., :total]
    return spread_lse, spread_delta


def dq_from_accumulator(acc: torch.Tensor, q: torch.Tensor, scale: float, use_triton: bool | None = None):
    """dQ = scale * ``acc`` (the kernel's fp32 accumulator, contiguous like q's shape) in q's dtype, laid out like
    q (torch.empty_like): one Triton kernel on CUDA (``use_triton`` forces it), torch elsewhere."""
    dq = torch.empty_like(q)
    if not (acc.is_cuda if use_triton is None else use_triton):
        return dq.copy_(acc * scale)
    from . import bwd_rows_kernel as k

    b, h, n, d = q.shape
    if any(stride % 8 for size, stride in zip(q.shape[:3], dq.stride()[:3]) if size > 1) or dq.stride(-1) != 1:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q was not TMA-ready: a contiguous dq
    if dq.numel():
        launch(k.scale_dq, (-(-n // k.BLOCK_ROWS), b * h), (acc, dq, scale, n, h, *_units(dq)), _dims(d),
               k.NUM_WARPS, k.NUM_STAGES, dtype_name=dtype_name(q.dtype))
    return dq


@dataclasses.dataclass(frozen=True)
class FlatDqOrder:
    """Where a FLAT_DQ kernel (the tile option flat_dq) leaves each element of a query block's dQ in its fp32
    accumulator: the block's ``tile_m`` rows x ``width`` columns (the kernel's head dim) are ``warpgroups`` shares of
    one 64 x N WGMMA accumulator tile each, split by rows (64 each), by columns, or with dQ transposed (dQ^T's tile:
    64 head-dim columns along M, the block's rows along N). A share is stored in its threads' register order: the
    accumulator value (a, b, j) of thread t = 32 w + l, lane l of warp w, is element (16 w + l // 4 + 8 b,
    8 j + 2 (l % 4) + a) of the tile (the sm90 WGMMA accumulator layout), its register index i = a + 2 b + 4 j, and
    it lies at 512 (i // 4) + 4 t + i % 4 of the share (the template's FLAT_DQ)."""

    tile_m: int
    width: int
    warpgroups: int
    split: str  # "rows", "columns" or "transposed"

    SPLITS = ("rows", "columns", "transposed")

    @classmethod
    def of(cls, tile: bwd_variants.Sm90BwdTile, head_dim: int) -> "FlatDqOrder":
        """The order of ``tile``'s kernel for ``head_dim`` (the template's DQ_SPLIT_ROWS and DQ_TRANSPOSED)."""
        width, warpgroups = bwd_variants.kernel_head_dim(head_dim), tile.consumer_warpgroups
        if tile.dq_transposed:
            split = "transposed"
        elif tile.tile_m == 64 * warpgroups and not tile.split_head_dim:
            split = "rows"
        else:
            split = "columns"
        return cls(tile.tile_m, width, warpgroups, split)

    def offsets(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The offset within its block's tile_m * width elements of element (``rows``, ``cols``) of the block
        (integer tensors that broadcast; rows < tile_m, cols < width). The same arithmetic as scale_flat_dq's."""
        if self.split == "rows":
            share, m, n, along_n = rows // 64, rows % 64, cols, self.width
        elif self.split == "columns":
            along_n = self.width // self.warpgroups
            share, m, n = cols // along_n, rows, cols % along_n
        else:
            share, m, n, along_n = cols // 64, cols % 64, rows, self.tile_m
        return (share * 64 * along_n + 512 * (n // 8) + 128 * (m // 16) + 16 * (m % 8) + 4 * ((n % 8) // 2)
                + 2 * ((m // 8) % 2) + n % 2)

    def accumulator(self, q: torch.Tensor) -> torch.Tensor:
        """An accumulator for q's (batch, heads, seqlen, head_dim), not zeroed (row_statistics does that): its rows
        padded to whole query blocks, at the kernel's head dim."""
        b, h, n, _ = q.shape
        return torch.empty((b, h, block_rows(n, self.tile_m), self.width), dtype=torch.float32, device=q.device)

    def constexprs(self) -> dict:
        """scale_flat_dq's constexprs for this order."""
        return {"TILE_M": self.tile_m, "WIDTH": self.width, "SPLIT": self.SPLITS.index(self.split),
                "WARPGROUPS": self.warpgroups}


def dq_from_flat_accumulator(acc: torch.Tensor, q: torch.Tensor, scale: float, order: FlatDqOrder,
                             use_triton: bool | None = None):
    """dQ = scale * the FLAT_DQ kernel's accumulator ``acc`` (FlatDqOrder.accumulator's shape) in q's dtype, its
    order undone: one Triton kernel on CUDA (``use_triton`` forces it), torch gathers elsewhere."""
    b, h, n, d = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not (acc.is_cuda if use_triton is None else use_triton):
        rows = torch.arange(acc.shape[2], device=acc.device)
        cols = torch.arange(order.width, device=acc.device)
        index = (rows // order.tile_m * order.tile_m * order.width)[:, None] + order.offsets(
            (rows % order.tile_m)[:, None], cols[None, :])
        gathered = acc.reshape(b, h, -1)[..., index.reshape(-1)].reshape(acc.shape)
        return dq.copy_(gathered[:, :, :n, :d] * scale)
    from . import bwd_rows_kernel as k

    if dq.numel():
        launch(k.scale_flat_dq, (-(-n // k.BLOCK_ROWS), b * h),
               (acc, dq, scale, n, acc.shape[2], h, *_units(dq)), {**_dims(d), **order.constexprs()},
               k.NUM_WARPS, k.NUM_STAGES, dtype_name=dtype_name(q.dtype))
    return dq


def _units(x: torch.Tensor) -> tuple[int, int, int]:
    """The batch, head and row strides of a TMA-ready 16-bit (batch, heads, seqlen, head_dim) tensor in 16-byte
    units, as bwd_rows_kernel takes them."""
    strides = [0 if size == 1 else stride for size, stride in zip(x.shape[:3], x.stride()[:3])]  # size 1: unread
    assert all(stride % 8 == 0 for stride in strides) and x.stride(-1) == 1, x.stride()
    return tuple(stride // 8 for stride in strides)


def _dims(head_dim: int) -> dict:
    """The kernels' constexprs for ``head_dim``: D is its tile width, the next power of two."""
    from . import bwd_rows_kernel as k

    return {"BLOCK_ROWS": k.BLOCK_ROWS, "HEAD_DIM": head_dim, "D": next_power_of_2(head_dim)}


def aot_builds(dtype: str, head_dim: int, arch: str = "sm90") -> list:
    """The KernelBuilds `attnforge build` compiles for the Triton kernels around a backward of ``dtype`` and
    ``head_dim`` (row statistics and the dQ scale), named as runtime.triton_launch looks them up."""
    from ...runtime.triton_aot import KernelBuild
    from . import bwd_rows_kernel as k

    def build(kernel: str, constexprs: dict):
        return KernelBuild(k.__file__, "bwd_rows_kernel", kernel, arch, dtype, _dims(head_dim)["D"], False, k.NUM_WARPS,
                           k.NUM_STAGES, signature=tuple(k.aot_signature(kernel, dtype).items()),
                           constexprs=tuple(constexprs.items()), aligned=k.AOT_ALIGNED[kernel])

    return [build("row_statistics", {**_dims(head_dim), "ACC_WIDTH": 0}), build("scale_dq", _dims(head_dim))]


def run(variant: Sm90BwdVariant, q, k, v, out, lse, dout, scale: float, dlse=None, dk=None, dv=None, scores=None,
        packed=None):
    """(dq, dk, dv) by ``variant``'s kernel from the forward's output and natural-log LSE (``dk``, ``dv``: where to
    write those, TMA-ready like k; default new tensors; ``scores``: for a variant with score features, the
    dispatch.call.Call whose window, softcap and ALiBi slopes its kernel takes; ``packed``: a VARLEN variant's dispatch.call.Varlen, the tensors then (1, heads, total, dim)
    views of the packed ones). The fp32 dQ accumulator (4 bytes per element of q) is the workspace this adds to the
    inputs' size.

    The kernel scales masked scores (-inf) like the forward does, so a negative or zero scale goes into q first
    (nonnegative_scale: q' = q * scale / scale'). Its dK = scale' dS^T q' is then already scale dS^T q, and dQ is
    scale dS K from the accumulator of dS K: the caller's scale, not scale'."""
    dq_scale = scale
    q, scale = nonnegative_scale(q, scale)
    q, k, v, dout = tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(dout)
    flat = FlatDqOrder.of(variant.tile, q.shape[-1]) if variant.tile.flat_dq else None
    # zeroed by row_statistics
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if flat is None else flat.accumulator(q)
    lse2, delta = row_statistics(out, dout, lse, dlse, variant.tile.tile_m, dq_accum=dq_accum)
    # deterministic: how many key blocks have added into each query block's dQ (else one per head, unread but the
    # first, a persistent kernel's tile counter)
    blocks = lse2.shape[-1] // variant.tile.tile_m if variant.deterministic else 1
    dq_order = torch.zeros((*q.shape[:2], blocks), dtype=torch.int32, device=q.device)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    bounds, scale_log2 = score_arguments(variant, scores, scale) if variant.features else ((), scale * LOG2_E)
    if variant.varlen:
        bounds_q, bounds_k = packed.bounds()
        tiles = key_tables(bounds_q, bounds_k, variant.tile.tile_m, variant.tile.tile_n, variant.causal, q.device)
        bounds = (*bounds, packed.cu_seqlens_q, packed.cu_seqlens_k, tiles)
        lse2, delta = spread_rows(lse2, delta, *packed_rows(bounds_q, variant.tile.tile_m, q.device))
    ctas = (max_ctas(q.device),) if variant.tile.persistent else ()
    variant.kernel(q, k, v, dout, lse2, delta, dq_accum, dq_order, dk, dv, scale_log2, scale, *ctas, *bounds)
    if flat is not None:
        return dq_from_flat_accumulator(dq_accum, q, dq_scale, flat), dk, dv
    return dq_from_accumulator(dq_accum, q, dq_scale), dk, dv

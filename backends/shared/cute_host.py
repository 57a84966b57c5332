"""Host-side pieces the CuTe-DSL backends (cute_sm90, cute_sm100) share: dtype names, input preparation for
TMA, the LSE allocation, the fake arguments their kernels are compiled against, and the compile factory
runtime.cute calls."""

from __future__ import annotations

import functools
import importlib.util

import torch

from ...dispatch.variant import Variant
from ...runtime import cute, generated
from ...runtime.cute import import_cutlass
from .cute_varlen import packed_arguments

DTYPE_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
LOG2_E = 1.4426950408889634  # the kernels work in exp2: they take scale * log2(e)
FACTORY = f"{__name__}:compile_arguments"  # what runtime.cute calls to trace a kernel of these backends
# The score features a CuTe kernel compiles in as template flags (WINDOW, SOFTCAP, SINKS, ALIBI), in the order their
# values follow the other arguments; a variant has a bool field of each name it can compile in.
SCORE_FEATURES = ("window", "softcap", "sinks", "alibi")


@functools.lru_cache(maxsize=None)
def max_ctas(device: torch.device) -> int:
    """The CTA count a persistent kernel (forward or backward, one CTA per SM) launches on ``device``: its SM count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def feature_flags(kinds) -> dict[str, bool]:
    """The variant fields (window=..., softcap=..., ...) for a feature set of `attnforge build --features`."""
    return {f: f in kinds for f in SCORE_FEATURES}


def problem_features(problem) -> dict[str, bool]:
    """The variant fields (window=..., softcap=..., ...) a Problem asks for."""
    return {"window": problem.mask.windowed, "softcap": bool(problem.softcap), "sinks": bool(problem.sinks),
            "alibi": bool(problem.alibi)}


def window_arguments(window_bounds: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A WINDOW kernel's (left, right) from the Mask's window_bounds (causal folded in, -1 unbounded): an unbounded
    side as seqlen_q + seqlen_k, which no row reaches and no Int32 sum overflows on."""
    return tuple(seqlen_q + seqlen_k if bound < 0 else bound for bound in window_bounds)


def cute_build(source, dtype: str, causal: bool, arch: str, cache_name: str, factory: str = FACTORY) -> cute.CuteBuild:
    """The runtime.cute.CuteBuild of a generated module (a codegen.Source) for one dtype and causality, compiled
    for ``arch`` into the cache folder ``cache_name``, traced by ``factory`` (default: this module's
    compile_arguments, for the forward kernels)."""
    return cute.CuteBuild(str(generated.path_for(source)), source.name, dtype, causal, arch, cache_name, factory)


class CuteVariant(Variant):
    """What the CuTe backends' variants share: a frozen dataclass subclass has ``tile``, ``dtype``, ``causal``,
    ``module`` and ``source`` and names its backend's compile module (``compile_module``: its ``ARCH`` and
    ``CACHE_NAME``); the compiled kernel is loaded or compiled on first use and is then
    an attribute lookup (the launch path of every call)."""

    compile_module = None
    factory = FACTORY  # the compile factory runtime.cute traces the kernel with

    @property
    def name(self) -> str:
        return f"{self.module}.{self.dtype}.{'causal' if self.causal else 'full'}"

    @functools.cached_property
    def features(self) -> tuple[str, ...]:
        """The score features compiled in (SCORE_FEATURES' names, in order; cached: the forward's launch path asks)."""
        return tuple(f for f in SCORE_FEATURES if getattr(self, f, False))

    @property
    def feature_suffix(self) -> str:
        """What the features (and a packed batch's VARLEN, a KV cache's KV_CACHE) add to the module name:
        "_window_softcap_varlen", "_kvcache", "_paged16", ..."""
        return "".join(f"_{f}" for f in self.features) + ("_varlen" if getattr(self, "varlen", False) else "") + {
            "": "", "contiguous": "_kvcache", "paged": f"_paged{getattr(self, 'page_rows', 0)}"}[
            getattr(self, "kv_cache", "")]

    @property
    def feature_note(self) -> str:
        """What the features (VARLEN, KV_CACHE) add to describe(): " +window+softcap packed (varlen)", ..."""
        return (f" +{'+'.join(self.features)}" if self.features else "") + (
            " packed (varlen)" if getattr(self, "varlen", False) else "") + {
            "": "", "contiguous": " KV cache",
            "paged": f" paged KV cache ({getattr(self, 'page_rows', 0)}-row loads)"}[getattr(self, "kv_cache", "")]

    def describe(self) -> str:
        return f"fwd {self.tile.describe()}{self.feature_note}"

    @functools.cached_property
    def build(self) -> cute.CuteBuild:
        return cute_build(self.source, self.dtype, self.causal, self.compile_module.ARCH, self.compile_module.CACHE_NAME,
                          self.factory)

    @functools.cached_property
    def kernel(self):
        """The callable compiled kernel."""
        return cute.compiled(self.build)


def score_arguments(variant, call, scale: float) -> tuple[tuple, float]:
    """(a forward kernel's trailing WINDOW/SOFTCAP/SINKS/ALIBI arguments, the scale_log2 it takes) for ``call`` and a
    variant with ``window``, ``softcap`` (and ``sinks``, ``alibi``) flags: the window bounds with causal folded in
    (unbounded: seqlen_q + seqlen_k, which no row reaches); with a softcap the pre-tanh scale / softcap, and
    softcap * log2(e) in place of scale * log2(e); the sink logits as a contiguous fp32 (heads_q,) tensor; the ALiBi
    slopes (batch, heads_q) negated and divided by the unit of the kernel's raw scores (scale, or the softcap)."""
    extra = ()
    scale_log2 = scale * LOG2_E
    if variant.window:  # (a KV cache's k is its rows or pages: its sequences are at most cache.longest long)
        extra = window_arguments(call.mask.window_bounds, call.q.shape[2],
                                 call.cache.longest if call.cache is not None else call.k.shape[2])
    if variant.softcap:
        extra, scale_log2 = (*extra, scale / call.softcap), call.softcap * LOG2_E
    if variant.sinks:
        extra = (*extra, call.sinks.detach().float().contiguous())
    if variant.alibi:
        extra = (*extra, call.alibi_slopes * (-1.0 / (call.softcap if variant.softcap else scale)))
    return extra, scale_log2


def trailing_arguments(variant, call, scale: float) -> tuple[tuple, float]:
    """(a forward kernel's arguments after max_ctas: a packed (VARLEN) kernel's offsets and tile table, or a KV_CACHE
    kernel's key counts (and block table), then the score features' values; the scale_log2 it takes) for ``call``:
    score_arguments and cute_varlen.packed_arguments where the variant has them, else nothing and scale * log2(e)."""
    extra, scale_log2 = score_arguments(variant, call, scale) if variant.features else ((), scale * LOG2_E)
    if variant.varlen:
        extra = (*packed_arguments(variant, call.varlen), *extra)
    kv_cache = getattr(variant, "kv_cache", "")
    if kv_cache:  # (the kernel takes unit inner strides: a strided view of either is copied, a few bytes a row)
        cache = call.cache
        table = cache.block_table
        pages = (table if table.stride(-1) == 1 else table.contiguous(),) if kv_cache == "paged" else ()
        extra = (cache.seqlens.contiguous(), *pages, *extra)
    return extra, scale_log2


def stack_missing() -> list[str]:
    """The reason the CuTe-DSL backends cannot run in this process, if a package they need is missing."""
    missing = [pkg for mod, pkg in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"))
               if importlib.util.find_spec(mod) is None]
    return [f"{', '.join(missing)} not installed (pip install 'attnforge[cute]')"] if missing else []


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs unit stride on head_dim, 16-byte aligned other strides and a 16-byte aligned start.
    (Every head_dim served is a multiple of 16 bytes, so a fresh contiguous copy qualifies.)"""
    if t.data_ptr() % 16 == 0 and (t.is_contiguous() or (
            t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))):
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=256)
def _lse_prototype(shape: torch.Size, device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device).expand(shape)


def lse_like(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A contiguous fp32 LSE of ``shape``: torch.empty_like() of a cached one-element prototype expanded to
    the shape allocates in about a third of torch.empty(shape, ...)'s time (no shape and device parsing;
    ~1 vs ~2.8 us on CPU)."""
    return torch.empty_like(_lse_prototype(shape, device))


def elements(dtype: str, arch: str):
    """(input, output) CuTe element types: FP8 (e4m3) in gives bf16 out."""
    cutlass = import_cutlass(arch)
    element = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN}[dtype]
    return element, (cutlass.BFloat16 if dtype == "fp8" else element)


def fake_arguments(dtype: str, head_dim: int, arch: str, takes_max_ctas: bool = False,
                   tail_split: bool = False, window: bool = False, softcap: bool = False, sinks: bool = False,
                   alibi: bool = False, varlen: bool = False, kv_cache: str = ""):
    """Fake arguments for cute.compile: q, k, v, out (batch, heads, seqlen, head_dim) with symbolic sizes
    and strides (16-byte aligned rows, as TMA needs), fp32 LSE (batch, heads, seqlen), then for FP8
    the descales (3, batch, heads_kv) in fp32, then scale_log2, with ``takes_max_ctas`` the Int32 CTA count a
    persistent kernel may launch (cute_sm90's take it; pass the SM count), with ``tail_split`` the pieces'
    fp32 workspaces (pieces, tile_m, head_dim) and (pieces, tile_m) and two Int32 counts (see cute_sm90/tail_split.py),
    with ``varlen`` the int32 offsets cu_seqlens_q and cu_seqlens_k (batch + 1,) and the tile table (tiles, 2) (see
    cute_varlen.py), with ``kv_cache`` ("contiguous", "paged") the int32 key counts (batch,) and for "paged" the int32
    block table (batch, max_pages) (k and v then have a batch of their own: the cache's rows or pages),
    with ``window`` the Int32 window bounds (left, right), with ``softcap`` the Float32 pre-tanh scale, with
    ``sinks`` the fp32 sink logits (heads_q,), with ``alibi`` the fp32 slopes (batch, heads_q), and the stream.
    FP8's v is V^T (batch, heads_kv, head_dim, seqlen_k padded to 32): see cute_sm90/v_layout.py."""
    cutlass = import_cutlass(arch)
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    element, out_element = elements(dtype, arch)
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, seqlen_v = (cute.sym_int32() for _ in range(6))

    def tensor(elem, *shape):
        strides = [cute.sym_int64(divisibility=16 // (elem.width // 8)) for _ in range(3)]
        return make_fake_tensor(elem, shape, (*strides, 1), assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (batch, heads_q, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=4)
    kv_batch = cute.sym_int32() if kv_cache else batch  # (a KV cache's rows or pages)
    q, k = tensor(element, batch, heads_q, seqlen_q, head_dim), tensor(element, kv_batch, heads_kv, seqlen_k, head_dim)
    out = tensor(out_element, batch, heads_q, seqlen_q, head_dim)
    max_ctas = (cutlass.Int32(1),) if takes_max_ctas else ()
    split = ()
    if tail_split:
        pieces, rows = cute.sym_int32(), cute.sym_int32()
        split = (make_fake_tensor(cutlass.Float32, (pieces, rows, head_dim), (cute.sym_int64(divisibility=4), head_dim, 1),
                                  assumed_align=16),
                 make_fake_tensor(cutlass.Float32, (pieces, rows), (cute.sym_int64(), 1), assumed_align=4),
                 cutlass.Int32(1), cutlass.Int32(1))
    packed = fake_packed() if varlen else fake_cache(batch, kv_cache)
    scores = fake_scores(batch, heads_q, window=window, softcap=softcap, sinks=sinks, alibi=alibi, varlen=varlen)
    tail = (cutlass.Float32(1.0), *max_ctas, *split, *packed, *scores, make_fake_stream(use_tvm_ffi_env_stream=True))
    if dtype != "fp8":
        return (q, k, tensor(element, kv_batch, heads_kv, seqlen_k, head_dim), out, lse, *tail)
    v_t = tensor(element, batch, heads_kv, head_dim, seqlen_v)
    descale = make_fake_tensor(cutlass.Float32, (3, batch, heads_kv), (cute.sym_int64(), cute.sym_int64(), 1),
                               assumed_align=4)
    return (q, k, v_t, out, lse, descale, *tail)


def fake_packed() -> tuple:
    """A packed (VARLEN) kernel's fake int32 offsets cu_seqlens_q and cu_seqlens_k (batch + 1,) and tile table
    (tiles, 2) (cute_varlen.py), forward or backward. (cutlass is imported for the target arch already.)"""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return (*(make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4) for _ in range(2)),
            make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=8))


def fake_cache(batch, kv_cache: str) -> tuple:
    """A KV_CACHE kernel's fake int32 key counts (batch,) and, for a "paged" cache, block table (batch, max_pages);
    nothing for ``kv_cache`` "". (cutlass is imported for the target arch already.)"""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if not kv_cache:
        return ()
    seqlens = make_fake_tensor(cutlass.Int32, (batch,), (1,), assumed_align=4)
    if kv_cache != "paged":
        return (seqlens,)
    return seqlens, make_fake_tensor(cutlass.Int32, (batch, cute.sym_int32()), (cute.sym_int64(), 1), assumed_align=4)


def fake_scores(batch, heads_q, *, window: bool = False, softcap: bool = False, sinks: bool = False,
                alibi: bool = False, varlen: bool = False) -> tuple:
    """The score features' fake values in the kernels' order (forward and backward): with ``window`` the Int32 bounds
    (left, right), with ``softcap`` the Float32 pre-tanh scale, with ``sinks`` the fp32 logits (heads_q,), with
    ``alibi`` the fp32 slopes (batch, heads_q): a row per sequence, so with ``varlen`` (q's batch 1) a count of
    their own."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    scores = ((cutlass.Int32(1), cutlass.Int32(1)) if window else ()) + ((cutlass.Float32(1.0),) if softcap else ())
    if sinks:
        scores += (make_fake_tensor(cutlass.Float32, (heads_q,), (1,), assumed_align=4),)
    if alibi:
        rows = cute.sym_int32() if varlen else batch
        scores += (make_fake_tensor(cutlass.Float32, (rows, heads_q), (cute.sym_int64(), 1), assumed_align=4),)
    return scores


def compile_arguments(module, dtype: str, causal: bool, arch: str):
    """runtime.cute's factory for these backends' kernels: the generated module's Forward for (dtype, causal)
    and the fake arguments it is traced with (the module says whether it takes the CTA count and the tail
    split's workspaces, a packed batch's offsets and tile table, a KV cache's key counts and block table and the
    score features' values: MAX_CTAS_ARGUMENT, TAIL_SPLIT, VARLEN, KV_CACHE, PAGED, WINDOW, SOFTCAP, SINKS, ALIBI)."""
    element, out_element = elements(dtype, arch)
    kv_cache = "paged" if getattr(module, "PAGED", False) else "contiguous" if getattr(module, "KV_CACHE", False) else ""
    args = fake_arguments(dtype, getattr(module, "INPUT_HEAD_DIM", module.HEAD_DIM), arch, takes_max_ctas=getattr(module, "MAX_CTAS_ARGUMENT", False),
                          tail_split=getattr(module, "TAIL_SPLIT", False), varlen=getattr(module, "VARLEN", False),
                          kv_cache=kv_cache, **{f: getattr(module, f.upper(), False) for f in SCORE_FEATURES})
    return module.Forward(element, out_element, causal), args

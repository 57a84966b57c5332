"""FA2-style Triton attention for NVIDIA (sm80+), forward and backward, from generated kernels.

Tiles come from variants.py per arch and head dim; the kernel modules are rendered from
templates/triton_fa2_{fwd,bwd}.py.jinja into the cache on first use (or by `attnforge build`). With
TRITON_INTERPRET=1 the same kernels run on CPU tensors in Triton's interpreter (tests and debugging),
using the sm80 tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ...codegen import Source
from ...dispatch.problem import KV_DTYPE_WORDS, KV_DTYPES, Problem
from ...dispatch.registry import Backend, Planned
from ...dispatch.support import Support
from ...dispatch.variant import Variant
from ...runtime import generated
from ...runtime.env import triton_interpret
from . import aot, variants


# The packed-row counts whose KV-cache tiles codegen renders and `attnforge build` compiles: a decode step of GQA
# with up to 16 query heads per KV head (block_m 16) and chunked prefill (the table's largest block_m that fits).
KV_ROWS = (16, 64)


def _kv_dtype_in(kinds: frozenset) -> str:
    """The fp8 cache format (Problem.kv_dtype) a build's feature set names, or "" (none)."""
    return next((name for name in KV_DTYPES if name and name in kinds), "")


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET as Triton itself reads it)."""
    return triton_interpret()


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dim with stride 1 (and TMA requires it); other strides are taken as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


def _window(variant, call) -> tuple[int, int] | None:
    """The (left, right) window a LOCAL variant's kernels take, causal folded in; None for the others."""
    return call.mask.window_bounds if variant.local else None


def _varlen(variant, call) -> tuple | None:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for a VARLEN variant's kernels; None otherwise."""
    if not variant.varlen:
        return None
    packed = call.varlen
    return packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q, packed.max_seqlen_k


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclasses.dataclass(frozen=True)
class TritonVariant(Variant):
    """One generated Triton module (a forward or a backward tile) for an arch, head dim, dtype and causality.
    ``arch`` is the arch whose table the tile came from (the interpreter uses its backend's
    interpreter_arch)."""

    family: str  # "fwd", "bwd" or "kvcache"
    tile: variants.FwdTile | variants.BwdTile | variants.KVTile
    template: str
    arch: str
    head_dim: int
    dtype: str
    causal: bool
    tuned: bool = False
    interpreted: bool = False
    local: bool = False  # a sliding window (the kernels' LOCAL; the window itself is the call's)
    softcap: bool = False  # capped scores (the kernels' SOFTCAP; the cap itself is the call's)
    sinks: bool = False  # a sink logit per query head (the forward's HAS_SINKS; the logits are the call's)
    alibi: bool = False  # ALiBi (the kernels' ALIBI; the slopes are the call's)
    paged: bool = False  # a KV-cache variant for paged caches (the kernel's PAGED)
    varlen: bool = False  # a packed batch, FlashAttention's varlen layout (the kernels' VARLEN)
    kv_dtype: str = ""  # a KV-cache variant for an fp8 cache (Problem.kv_dtype: the kernel's FP8_KV, K/V's type)

    @property
    def fp8_kv(self) -> bool:
        """Whether it reads an fp8 cache (the kernel's FP8_KV)."""
        return bool(self.kv_dtype)

    @property
    def name(self) -> str:
        return (f"{self.tile.module}.{self.arch}.{self.dtype}.d{self.head_dim}."
                f"{'causal' if self.causal else 'full'}{'.local' if self.local else ''}"
                f"{'.softcap' if self.softcap else ''}{'.sinks' if self.sinks else ''}"
                f"{'.alibi' if self.alibi else ''}{'.paged' if self.paged else ''}{'.varlen' if self.varlen else ''}"
                f"{f'.{self.kv_dtype}kv' if self.kv_dtype else ''}")

    def describe(self) -> str:
        features = [f for f, on in (("window", self.local), ("softcap", self.softcap), ("sinks", self.sinks),
                                    ("alibi", self.alibi), ("varlen", self.varlen),
                                    (f"{KV_DTYPE_WORDS.get(self.kv_dtype)} cache", self.fp8_kv)) if on]
        return (self.tile.describe() + (f" +{'+'.join(features)}" if features else "") + (" (tuned)" if self.tuned else "")
                + (" (interpreter)" if self.interpreted else ""))

    @property
    def source(self) -> Source:
        return Source.of(self.template, self.tile.params(), self.tile.module)

    @functools.cached_property
    def module(self):
        """The generated module, rendered into the cache and imported on first use."""
        return generated.load(self.source)


class TritonFA2Backend(Backend):
    """Also the base of triton_rocm: a subclass swaps the variant tables, the templates and the arch whose
    tiles the interpreter uses; the kernels' math is the same."""

    name = "triton_fa2"
    summary = "FA2-style Triton kernels rendered from templates/triton_fa2_*.py.jinja"
    variants_table = variants
    templates = {"fwd": "triton_fa2_fwd.py.jinja", "bwd": "triton_fa2_bwd.py.jinja", "kvcache": "triton_kvcache.py.jinja"}
    interpreter_arch = "sm80"  # tiles used when the interpreter runs the kernels on the CPU
    support = Support(
        vendors=frozenset({"nvidia", "cpu"}),
        archs=frozenset(variants.FWD) | {"cpu"},
        dtypes=frozenset({"fp16", "bf16"}),
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,  # not implemented (no Philox mask yet); sdpa serves dropout
        empty=False,  # zero-sized grids; reference serves empty problems
        window=True,  # LOCAL kernels: key (query) blocks outside the window are skipped, its edges masked
        softcap=True,  # SOFTCAP kernels
        sinks=True,  # the forward's HAS_SINKS; the backward recomputes P from the LSE, which counts the sink
        alibi=True,  # ALIBI kernels
        kv_cache=frozenset({"contiguous", "paged"}),  # templates/triton_kvcache.py.jinja: split-KV, pack-GQA
        kv_cache_dtypes=frozenset({"fp8"}),  # its FP8_KV kernels, on the archs of FP8_KV_ARCHS
        kv_leftpad=True,
        kv_unchecked=True,  # lengths and pages outside the cache give NaN rows; nothing outside it is read
        varlen=True,  # the VARLEN kernels: one launch for a packed batch, a sequence's rows found by its offsets
    )
    # the multiprocessors the split heuristic fills when the interpreter runs the kernels (few: tests split)
    interpreter_multiprocessors = 4
    # per fp8 cache format (Problem.kv_dtype), the archs where Triton converts it in hardware: e4m3 (fp8e4nv) on
    # Ada and later (sm80/sm86 have no fp8 conversion)
    FP8_KV_ARCHS: dict[str, tuple[str, ...]] = {"fp8": ("sm89", "sm90", "sm100", "sm120")}

    def available(self) -> list[str]:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return [f"triton is not importable ({exc})"]
        return []

    def _table(self, family: str) -> dict:
        return {"fwd": self.variants_table.FWD, "bwd": self.variants_table.BWD,
                "kvcache": self.variants_table.KVCACHE, "kvcache-paged": self.variants_table.KVCACHE_PAGED}[family]

    def _variant(self, family: str, arch: str, head_dim: int, dtype: str, causal: bool,
                 interpreted: bool = False, local: bool = False, softcap: bool = False, sinks: bool = False,
                 alibi: bool = False, varlen: bool = False) -> Planned:
        tile, reasons = variants.pick(self._table(family), arch, head_dim, backend=self.name)
        if tile is None:
            return None, reasons
        tuned = self.variants_table is variants and tile == variants.tuned_tile(family, arch, head_dim)
        if varlen and getattr(tile, "loads", "pointer") != "pointer":
            # a sequence's rows start anywhere in the packed tensor: its kernel masks pointer loads per sequence
            # (the same tile, which passes the one check with either load style on these archs)
            tile = dataclasses.replace(tile, loads="pointer")
        return TritonVariant(family, tile, self.templates[family], arch, head_dim, dtype, causal, tuned, interpreted,
                             local, softcap, sinks, alibi, varlen=varlen), []

    def _plan_family(self, problem: Problem, family: str) -> Planned:
        reasons = []
        cpu = problem.device.vendor == "cpu"
        if cpu and not interpreting():
            reasons.append("runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        arch = self.interpreter_arch if cpu else problem.device.arch
        variant, why = self._variant(family, arch, problem.head_dim, problem.dtype, problem.causal, cpu,
                                     problem.mask.windowed, problem.softcap, problem.sinks, problem.alibi,
                                     problem.varlen)
        reasons += why
        return (None, reasons) if reasons else (variant, [])

    def _plan_kvcache(self, problem: Problem) -> Planned:
        reasons = []
        cpu = problem.device.vendor == "cpu"
        if cpu and not interpreting():
            reasons.append("runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"head_dim_v {problem.head_dim_v} != head_dim {problem.head_dim}")
        if problem.alibi:
            reasons.append("ALiBi is not in its KV-cache kernel")
        fp8_archs = self.FP8_KV_ARCHS.get(problem.kv_dtype, ())
        if fp8_archs and not cpu and problem.device.arch not in fp8_archs:
            reasons.append(f"an {KV_DTYPE_WORDS[problem.kv_dtype]} KV cache needs its conversion in hardware "
                           f"({', '.join(fp8_archs)}; "
                           f"the device is {problem.device.arch})")
        arch = self.interpreter_arch if cpu else problem.device.arch
        rows = problem.seqlen_q * (problem.heads_q // max(problem.heads_kv, 1))
        table = self._table("kvcache-paged" if problem.kv_cache == "paged" else "kvcache")
        tile, why = variants.kv_tile(table, arch, problem.head_dim, rows)
        reasons += why
        if reasons:
            return None, reasons
        return TritonVariant("kvcache", tile, self.templates["kvcache"], arch, problem.head_dim, problem.dtype,
                             problem.causal, False, cpu, problem.mask.windowed, problem.softcap, problem.sinks,
                             paged=problem.kv_cache == "paged", kv_dtype=problem.kv_dtype), []

    def _plan(self, problem: Problem) -> Planned:
        if problem.kv_cache:
            return self._plan_kvcache(problem)
        return self._plan_family(problem, "fwd")

    def _plan_backward(self, problem: Problem) -> Planned:
        if problem.kv_cache:
            return None, ["its KV-cache kernel has no backward"]
        return self._plan_family(problem, "bwd")

    def variants(self, archs=None, dtypes=None, head_dims=None, causal=(False, True), strict=False,
                 deterministic=False, features=()) -> list[TritonVariant]:
        own = self.variants_table.FWD
        out = []
        for arch in (own if archs is None else [a for a in archs if a in own]):
            for head_dim in head_dims or variants.HEAD_DIMS:
                for dtype in dtypes or ("fp16", "bf16"):
                    if dtype not in self.support.dtypes:
                        continue
                    attention_sets = [kinds for kinds in features if "kvcache" not in kinds]
                    kv_sets = [kinds for kinds in features if "kvcache" in kinds and "alibi" not in kinds]
                    # a head dim only the KV-cache kernel serves (variants.KV_HEAD_DIMS) builds its KV-cache kernels
                    kv_only = head_dim not in variants.HEAD_DIMS and bool(kv_sets)
                    if kv_only and strict and head_dim not in variants.KV_HEAD_DIMS:
                        raise ValueError(f"{self.name} {arch}: head_dim {head_dim} has no KV-cache kernel (has every "
                                         "multiple of 8 from 16 to 256)")
                    families = (() if kv_only
                                else itertools.product(causal, (frozenset(), *attention_sets), ("fwd", "bwd")))
                    for flag, kinds, family in families:
                        variant, why = self._variant(family, arch, head_dim, dtype, flag, local="window" in kinds,
                                                     softcap="softcap" in kinds, sinks="sinks" in kinds,
                                                     alibi="alibi" in kinds, varlen="varlen" in kinds)
                        if variant is None:
                            if strict:
                                raise ValueError(f"{self.name} {arch}: " + "; ".join(why))  # the reason already says "head_dim N"
                            continue
                        if variant not in out:
                            out.append(variant)
                    for flag, kinds, rows, paged in itertools.product(causal, kv_sets, KV_ROWS, (False, True)):
                        variant = self._kvcache_variant(arch, head_dim, dtype, flag, rows, paged, kinds)
                        missing = variant is None and strict and self._fp8_kv_reason(arch, _kv_dtype_in(kinds))
                        if missing:
                            raise ValueError(f"{self.name} {arch}: {missing}")
                        if variant is not None and variant not in out:
                            out.append(variant)
        return out

    def _fp8_kv_reason(self, arch: str, kv_dtype: str) -> str:
        """Why ``arch`` has no KV-cache kernel for the fp8 cache format ``kv_dtype`` ("": it has, or none asked)."""
        archs = self.FP8_KV_ARCHS.get(kv_dtype, ())
        if not kv_dtype or arch in archs:
            return ""
        return (f"an {KV_DTYPE_WORDS[kv_dtype]} KV cache has no kernel here (converted in hardware on "
                f"{', '.join(archs) or 'no arch it builds for'})")

    def _kvcache_variant(self, arch: str, head_dim: int, dtype: str, causal: bool, rows: int, paged: bool,
                         kinds: frozenset) -> TritonVariant | None:
        """The KV-cache variant for these rows and layout, with the features of ``kinds`` ("kvcache" and any of
        "window", "softcap", "sinks", and "fp8" or "fp8_fnuz": an fp8 cache of that format (Problem.kv_dtype), on
        the archs that convert it)."""
        tile, _ = variants.kv_tile(self._table("kvcache-paged" if paged else "kvcache"), arch, head_dim, rows)
        kv_dtype = _kv_dtype_in(kinds)
        if tile is None or self._fp8_kv_reason(arch, kv_dtype):
            return None
        return TritonVariant("kvcache", tile, self.templates["kvcache"], arch, head_dim, dtype, causal,
                             local="window" in kinds, softcap="softcap" in kinds, sinks="sinks" in kinds, paged=paged,
                             kv_dtype=kv_dtype)

    def builds(self, variant: TritonVariant) -> list:
        return aot.builds(variant, generated.path_for(variant.source))

    def _multiprocessors(self, device: torch.device) -> int:
        if device.type == "cpu":
            return self.interpreter_multiprocessors
        return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())

    def _forward_kvcache(self, variant: TritonVariant, call):
        q, k, v, cache = call.q, call.k, call.v, call.cache
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("the KV-cache kernel reads caches with unit stride in head_dim (they are written in place)")
        q = _unit_stride(q)
        batch, heads, seqlen_q, _ = q.shape
        out = torch.empty((batch, seqlen_q, heads, v.shape[3]), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        tile = variant.tile
        ctas = -(-seqlen_q * (heads // k.shape[1]) // tile.block_m) * batch * k.shape[1]
        splits, per_split = variants.kv_splits(ctas, cache.longest, tile.block_n, self._multiprocessors(q.device),
                                               cache.num_splits, paged=cache.block_table is not None,
                                               ctas_per_multiprocessor=variants.kv_ctas_per_multiprocessor(
                                                   tile, variant.arch, variant.head_dim))
        sinks = None if call.sinks is None else call.sinks.to(torch.float32).contiguous()
        variant.module.launch(q, k, v, out, lse, cache.seqlens, causal=variant.causal, scale=call.scale,
                              num_splits=splits, keys_per_split=per_split, leftpad=cache.leftpad,
                              block_table=cache.block_table, window=_window(variant, call), softcap=call.softcap,
                              sinks=sinks, descale=cache.descale)
        return out, lse

    def forward(self, variant: TritonVariant, call):
        if variant.family == "kvcache":
            return self._forward_kvcache(variant, call)
        q, k, v = _unit_stride(call.q), _unit_stride(call.k), _unit_stride(call.v)
        out = torch.empty_like(q)  # same strides as q when q is dense (bshd stays bshd), else contiguous
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        sinks = None if call.sinks is None else call.sinks.to(torch.float32).contiguous()
        variant.module.launch(q, k, v, out, lse, causal=variant.causal, scale=call.scale, window=_window(variant, call),
                              softcap=call.softcap, sinks=sinks, alibi_slopes=call.alibi_slopes,
                              varlen=_varlen(variant, call))
        return out, lse

    def backward(self, variant: TritonVariant, call, out, lse, dout, dlse=None):
        q, k, v, dout = _unit_stride(call.q), _unit_stride(call.k), _unit_stride(call.v), _unit_stride(dout)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dlse = None if dlse is None else dlse.to(torch.float32)
        variant.module.launch(q, k, v, out, lse, dout, dq, dk, dv, causal=variant.causal, scale=call.scale, dlse=dlse,
                              window=_window(variant, call), softcap=call.softcap, alibi_slopes=call.alibi_slopes,
                              varlen=_varlen(variant, call))
        return dq, dk, dv

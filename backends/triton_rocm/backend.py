"""FA2-style Triton attention for AMD CDNA (gfx90a, gfx942, gfx950): triton_fa2's kernels with
AMD tiles and compile options (variants.py), rendered from templates/triton_rocm_*.py.jinja."""

from __future__ import annotations

from ...dispatch.support import Support
from ..triton_fa2.backend import TritonFA2Backend
from . import variants


class TritonRocmBackend(TritonFA2Backend):
    name = "triton_rocm"
    summary = "FA2-style Triton kernels tuned for AMD CDNA (compiled and interpreter-tested, not run on AMD hardware)"
    variants_table = variants
    templates = {"fwd": "triton_rocm_fwd.py.jinja", "bwd": "triton_rocm_bwd.py.jinja", "kvcache": "triton_kvcache.py.jinja"}
    interpreter_arch = "gfx942"
    # the fp8 format each CDNA generation converts in hardware (Problem.kv_dtype): CDNA3 (gfx942) e4m3fnuz by
    # v_cvt_pk_f32_fp8, CDNA4 (gfx950) OCP e4m3 by v_cvt_scalef32_pk_bf16_fp8 / _f16_fp8 (checked in
    # tests/backends/triton_rocm/test_compile.py); Triton would emulate the other format in integer code, which is
    # not built. CDNA2 (gfx90a) has no fp8.
    FP8_KV_ARCHS = {"fp8": ("gfx950",), "fp8_fnuz": ("gfx942",)}
    support = Support(
        vendors=frozenset({"amd", "cpu"}),
        archs=frozenset(variants.FWD) | {"cpu"},  # CDNA only: RDNA (gfx11xx) has no MFMA
        dtypes=frozenset({"fp16", "bf16"}),  # fp8 (e4m3fnuz on gfx942) not implemented yet
        max_head_dim=max(variants.HEAD_DIMS),
        dropout=False,
        empty=False,
        window=True,  # the shared template's LOCAL kernels
        softcap=True,  # and its SOFTCAP kernels
        sinks=True,  # and its HAS_SINKS forward
        alibi=True,  # and its ALIBI kernels
        kv_cache=frozenset({"contiguous", "paged"}),  # the shared KV-cache template, with CDNA tiles
        kv_cache_dtypes=frozenset({"fp8", "fp8_fnuz"}),  # the template's FP8_KV, on the archs of FP8_KV_ARCHS
        kv_leftpad=True,
        kv_unchecked=True,  # lengths and pages outside the cache give NaN rows; nothing outside it is read
        varlen=True,  # the VARLEN kernels: one launch for a packed batch, a sequence's rows found by its offsets
    )

"""What cute_sm90 compiles: its kernels' arch and dtypes, and the runtime.cute.CuteBuild of a variant.
runtime/cute.py does the compiling, exporting and loading (with no GPU if need be)."""

from __future__ import annotations

from ...runtime import generated
from ...runtime.cute import CuteBuild
from ..shared.cute_host import FACTORY

ARCH = "sm_90a"
DTYPES = ("fp16", "bf16", "fp8")
KIND = {"fp16": "16bit", "bf16": "16bit", "fp8": "fp8"}
TEMPLATE = "cute_sm90_fwd.py.jinja"
CACHE_NAME = "cute_sm90"


def cute_build(source, dtype: str, causal: bool, arch: str = ARCH, cache_name: str = CACHE_NAME) -> CuteBuild:
    """The CuteBuild of a generated module (a codegen.Source) for one dtype and causality."""
    return CuteBuild(str(generated.path_for(source)), source.name, dtype, causal, arch, cache_name, FACTORY)

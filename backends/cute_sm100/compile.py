"""What cute_sm100 compiles: its kernels' arch and dtypes, and the runtime.cute.CuteBuild of a variant.
The CuTe DSL fixes its target arch when it is imported, so a process that already compiles for sm_90a
(a CI run of both, say) builds these in a child process with CUTE_DSL_ARCH=sm_100a (runtime/cute.py)."""

from __future__ import annotations

from ...runtime import generated
from ...runtime.cute import CuteBuild
from ..shared.cute_host import FACTORY

ARCH = "sm_100a"
DTYPES = ("fp16", "bf16")
TEMPLATE = "cute_sm100_fwd.py.jinja"
CACHE_NAME = "cute_sm100"


def cute_build(source, dtype: str, causal: bool) -> CuteBuild:
    """The CuteBuild of a generated module (a codegen.Source) for one dtype and causality."""
    return CuteBuild(str(generated.path_for(source)), source.name, dtype, causal, ARCH, CACHE_NAME, FACTORY)

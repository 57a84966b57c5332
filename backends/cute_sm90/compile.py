"""What cute_sm90 compiles: its kernels' arch and dtypes, and the runtime.cute.CuteBuild of a variant.
runtime/cute.py does the compiling, exporting and loading (with no GPU if need be)."""

from __future__ import annotations

import functools

from ..shared import cute_host

ARCH = "sm_90a"
DTYPES = ("fp16", "bf16", "fp8")
KIND = {"fp16": "16bit", "bf16": "16bit", "fp8": "fp8"}
TEMPLATE = "cute_sm90_fwd.py.jinja"
CACHE_NAME = "cute_sm90"

# The CuteBuild of a generated module (a codegen.Source) for one dtype and causality: cute_build(source, dtype,
# causal) (tile sweeps and benchmarks build their own Sources).
cute_build = functools.partial(cute_host.cute_build, arch=ARCH, cache_name=CACHE_NAME)

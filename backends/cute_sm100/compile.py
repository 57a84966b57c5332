"""What cute_sm100 compiles: its kernels' arch, dtypes, template and cache folder (the CuteBuild of a
variant is cute_host.cute_build's).
The CuTe DSL fixes its target arch when it is imported, so a process that already compiles for sm_90a
(a CI run of both, say) builds these in a child process with CUTE_DSL_ARCH=sm_100a (runtime/cute.py)."""

from __future__ import annotations

ARCH = "sm_100a"
DTYPES = ("fp16", "bf16")
TEMPLATE = "cute_sm100_fwd.py.jinja"
CACHE_NAME = "cute_sm100"

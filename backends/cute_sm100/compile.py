"""Compiling and caching the generated cute_sm100 kernels: cute_sm90's machinery (its compile.Target)
for sm_100a. The CuTe DSL fixes its target arch when it is imported, so a process that already
compiles for sm_90a (a CI run of both, say) builds these in a child process with CUTE_DSL_ARCH=sm_100a.
"""

from __future__ import annotations

from ..cute_sm90.compile import Target

ARCH = "sm_100a"
DTYPES = ("fp16", "bf16")

TARGET = Target(ARCH, __package__, "cute_sm100")
kernel_module, compile_kernel, compile_in_child = TARGET.kernel_module, TARGET.compile_kernel, TARGET.compile_in_child
cache_path, build_cached, compiled = TARGET.cache_path, TARGET.build_cached, TARGET.compiled

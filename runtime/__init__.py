"""The runtime layer: the build cache, generated-module loading, Triton ahead-of-time compile/load/launch
and CuTe-DSL compile/export/load. It names no backend: backends hand it what to build as data
(a ``triton_aot.KernelBuild``, a ``cute.CuteBuild``) and it compiles, caches and loads those."""

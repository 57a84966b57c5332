"""The ``triton_rocm`` backend: FlashAttention-2-style Triton kernels for AMD CDNA GPUs."""

from .backend import TritonRocmBackend

__all__ = ["TritonRocmBackend"]

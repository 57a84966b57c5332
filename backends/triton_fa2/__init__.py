"""The ``triton_fa2`` backend: FlashAttention-2-style Triton kernels for NVIDIA sm80+."""

from .backend import TritonFA2Backend

__all__ = ["TritonFA2Backend"]

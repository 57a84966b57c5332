"""The ``reference`` backend: attnforge's own tiled online softmax in PyTorch (any device)."""

from .backend import ReferenceBackend
from .kernels import math_attention

__all__ = ["ReferenceBackend", "math_attention"]

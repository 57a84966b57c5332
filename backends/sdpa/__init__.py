"""The ``sdpa`` backend: PyTorch's scaled_dot_product_attention."""

from .backend import SdpaBackend

__all__ = ["SdpaBackend"]

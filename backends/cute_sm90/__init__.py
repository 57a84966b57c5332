"""The ``cute_sm90`` backend: FlashAttention-3-style TMA + WGMMA forward for Hopper, in the CuTe DSL."""

from .backend import CuteSm90Backend

__all__ = ["CuteSm90Backend"]

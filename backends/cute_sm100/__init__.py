"""The ``cute_sm100`` backend: a tcgen05 / tensor-memory forward for Blackwell, in the CuTe DSL
(compiled and checked for sm_100a; not yet run on a Blackwell GPU)."""

from .backend import CuteSm100Backend

__all__ = ["CuteSm100Backend"]

"""The mask rule (dispatch/mask.py) for Triton kernels, written once: bottom-right aligned causal, query
row i sees key j iff j <= i + N_K - N_Q. @triton.jit helpers are inlined where they are called, so these
cost nothing over writing the expression in place."""

import triton
import triton.language as tl


@triton.jit
def causal_visible(row, col, N_Q, N_K):
    """Whether query ``row`` sees key ``col`` (broadcast against each other)."""
    return col <= row + (N_K - N_Q)


@triton.jit
def diagonal(row, N_Q, N_K):
    """The last key query ``row`` sees: keys below ``diagonal(end)`` are all that rows below ``end`` need."""
    return row + N_K - N_Q


@triton.jit
def first_row(col, N_Q, N_K):
    """The first query row that sees key ``col`` (may be negative or past N_Q)."""
    return col - (N_K - N_Q)

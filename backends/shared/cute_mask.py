"""The mask rule (dispatch/mask.py) for CuTe-DSL kernels, written once: bottom-right aligned causal, query
row i sees key j iff j <= i + seqlen_k - seqlen_q. Plain functions of DSL values: the kernels call them
while cute.compile traces, so each call is the expression itself in the kernel's IR."""


def key_limit(row, seqlen_q, seqlen_k):
    """Keys j < key_limit(row) are visible to query ``row`` (one past its diagonal)."""
    return row + 1 + seqlen_k - seqlen_q


def diagonal(row, seqlen_q, seqlen_k):
    """The last key query ``row`` sees: keys below ``diagonal(end)`` are all that rows below ``end`` need,
    and the key blocks below ``diagonal(first) // block`` need no mask for rows from ``first`` on."""
    return row + seqlen_k - seqlen_q


def first_row(key, seqlen_q, seqlen_k):
    """The first query row that sees ``key`` (the row whose diagonal it is; below 0: every row sees it)."""
    return key - seqlen_k + seqlen_q

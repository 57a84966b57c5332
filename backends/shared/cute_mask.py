"""The mask rule (dispatch/mask.py) and the score features for CuTe-DSL kernels, written once: bottom-right aligned
causal, query row i sees key j iff j <= i + seqlen_k - seqlen_q; a sliding window (left, right) keeps
i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; softcap turns a score s into
softcap * tanh(scale * s / softcap); ALiBi adds -slope * |i + seqlen_k - seqlen_q - j|; a sink logit joins each
row's softmax denominator; a backward multiplies dS by the cap's derivative (cap_derivative). Plain functions
of DSL values: the kernels call them while cute.compile traces, so each call is the expression itself in the kernel's IR."""


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


def window_key_limit(row, seqlen_q, seqlen_k, right):
    """With a window, keys j < window_key_limit(row) are visible to query ``row`` (``right`` keys past its
    diagonal; causal is right = 0; an unbounded right is passed as any value >= seqlen_k)."""
    return row + 1 + seqlen_k - seqlen_q + right


def window_first_key(row, seqlen_q, seqlen_k, left):
    """With a window, the first key query ``row`` sees (``left`` keys before its diagonal; below 0: key 0; an
    unbounded left is passed as any value >= seqlen_q + seqlen_k)."""
    return row + seqlen_k - seqlen_q - left


def capped(score, cap_scale):
    """softcap's tanh(cap_scale * score), cap_scale = scale / softcap (the kernel multiplies by softcap * log2(e)
    after it): tanh.approx.f32 (MUFU.TANH, max relative error about 2^-11, below bf16's and fp16's rounding of
    the inputs)."""
    import cutlass.cute as cute

    return cute.math.tanh(score * cap_scale, approx=True)


def cap_derivative(p, lse_log2, inv_scale_log2, bias):
    """softcap's chain-rule factor for a backward: d tanh(x) / dx = 1 - tanh(x)^2 for a score whose probability is
    ``p`` = exp2((tanh(x) + bias) * scale_log2 - lse_log2) (``bias``: ALiBi's, in the same units; ``inv_scale_log2``
    = 1 / scale_log2), so tanh(x) = (log2(p) + lse_log2) * inv_scale_log2 - bias: recovered from P instead of kept.
    Where P is 0 (a masked key, a row that saw no key and whose LSE is +inf) the log is -inf or NaN: the max with 0
    (max.f32 returns its operand that is not NaN) makes the factor 0, as it does where rounding puts |tanh| past 1."""
    import cutlass
    import cutlass.cute as cute

    t = (cute.math.log2(p, fastmath=True) + lse_log2) * inv_scale_log2 - bias
    return cute.arch.fmax(1.0 - t * t, cutlass.Float32(0.0))


def with_sink(max_log2, total, sink_log2):
    """A row's softmax with a sink logit (gpt-oss) counted in its denominator: from the row's running max and sum
    of exp2 over its keys (``max_log2``, in log2 units, -inf for a row that saw no key; ``total`` relative to it)
    and the sink in log2 units, returns (``keys``, ``total``, ``max``): the factor that moves the keys' sum (and
    the unnormalised output) to the new max, the sum with the sink, and the new max. The output is then
    acc * keys / total and the LSE (max + log2(total)) * ln 2, so a row that sees no key gives 0 and LSE = its
    sink. (A sink of -inf with no key leaves a total of 0: the caller's "saw nothing" case.)"""
    import cutlass
    import cutlass.cute as cute

    # clamped to the lowest finite float: with no key and a sink of -inf, exp2(-inf - it) is 0, not NaN
    new_max = cute.arch.fmax(cute.arch.fmax(max_log2, sink_log2), cutlass.Float32(-3.4028234663852886e38))
    keys = cute.math.exp2(max_log2 - new_max, fastmath=True)
    return keys, total * keys + cute.math.exp2(sink_log2 - new_max, fastmath=True), new_max


def alibi_biased(score, slope, distance):
    """ALiBi: ``score`` plus ``slope`` (negative, in the score's units) times |distance| (query's diagonal key minus
    this key, an Int32)."""
    import cutlass

    return score + slope * cutlass.Float32(cutlass.max(distance, -distance))

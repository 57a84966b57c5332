"""backends/shared/cute_math.py's exp2 on the FMA pipe, its PTX sequence emulated step by step in fp32 (each .rn
operation rounded to fp32, the integer multiply-add modulo 2^32) on fresh random and edge inputs, against fp64 2^x;
and the PTX the kernels inline is that sequence."""

import numpy as np
import pytest

pytest.importorskip("cutlass")
from attnforge.backends.shared import cute_math  # noqa: E402


def f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def emulated(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    x = np.where(np.isnan(x), x, np.maximum(x, f32(cute_math.FLOOR)))  # max.NaN
    t = (x + f32(cute_math.ROUND)).astype(np.float32)
    j = (t - f32(cute_math.ROUND)).astype(np.float32)
    f = (x - j).astype(np.float32)

    def fma(a, b, c):  # a*b is exact in fp64 for fp32 a and b; one rounding to fp32
        return (a.astype(np.float64) * b + c).astype(np.float32)

    c = [np.float64(f32(bits)) for bits in cute_math.COEFFICIENTS]
    p = fma(f, c[-1], c[-2])  # Horner, highest power first, as the PTX
    for coefficient in reversed(c[:-2]):
        p = fma(p, f.astype(np.float64), coefficient)
    p = fma(p, f.astype(np.float64), 1.0)
    bits = (t.view(np.uint32).astype(np.uint64) * (1 << 23) + p.view(np.uint32)) % (1 << 32)
    return bits.astype(np.uint32).view(np.float32)


def test_relative_error_is_about_mufu_ex2s_on_random_softmax_arguments():
    """The row sums (and so the LSE) add these fp32 values: their error must be about MUFU.EX2's (2^-22 relative,
    PTX ISA's ex2.approx.f32), not merely below a 16-bit P's rounding."""
    rng = np.random.default_rng()
    x = np.concatenate([rng.uniform(-126, 8, 200_000), rng.uniform(-1, 1, 100_000)]).astype(np.float32)
    got = emulated(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1)
    assert rel.max() <= 2.0 ** -22, (rel.max(), x[rel.argmax()])


@pytest.mark.parametrize("x, want", [(0.0, 1.0), (1.0, 2.0), (-1.0, 0.5), (-126.0, 2.0 ** -126), (-127.0, 0.0),
                                     (-200.0, 0.0), (-np.inf, 0.0), (np.nan, np.nan), (8.0, 256.0)])
def test_edges(x, want):
    got = float(emulated(np.array([x]))[0])
    if np.isnan(want):
        assert np.isnan(got)
    elif want == 0.0:
        assert got == 0.0 and not np.signbit(got)  # +0: a masked score's P
    else:
        assert abs(got / want - 1) <= 2.0 ** -22


def test_the_ptx_is_the_emulated_sequence():
    ptx = cute_math._PTX
    c = [f"0f{bits:08X}" for bits in cute_math.COEFFICIENTS]
    order = ["max.NaN.f32", f"add.rn.f32 t, x, 0f{cute_math.ROUND:08X}", "sub.rn.f32 j", "sub.rn.f32 f",
             f"fma.rn.f32 p, f, {c[4]}, {c[3]}", f"fma.rn.f32 p, p, f, {c[2]}", f"fma.rn.f32 p, p, f, {c[1]}",
             f"fma.rn.f32 p, p, f, {c[0]}", "fma.rn.f32 p, p, f, 0f3F800000", "mad.lo.s32 tb, tb, 8388608, pb"]
    positions = [ptx.index(op) for op in order]
    assert positions == sorted(positions)
    assert ptx.count("fma.rn.f32") == len(cute_math.COEFFICIENTS)
    assert f"0f{cute_math.FLOOR:08X}" in ptx


def test_columns_on_the_fma_pipe():
    assert [c for c in range(8) if cute_math.on_fma_pipe(c, 2)] == [1, 3, 5, 7]
    assert [c for c in range(8) if cute_math.on_fma_pipe(c, 4)] == [3, 7]
    assert not any(cute_math.on_fma_pipe(c, 0) for c in range(8))

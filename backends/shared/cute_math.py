"""exp2 on the FMA pipe, for CuTe-DSL kernels whose softmax keeps the MUFU pipe as busy as the tensor cores.

A softcapped score takes two MUFU operations (tanh, then exp2): at head dim 128 on Hopper that is as much MUFU time
per score as the tensor cores' (16 MUFU results per SM per clock against 4096 dense 16-bit FLOPs, 512 of them per
score), so the forward runs below the plain kernel. Moving some of the exp2s to the FMA pipe (128 fp32 lanes per SM)
takes that share off the MUFU pipe; FlashAttention-4 does the same on Blackwell.

2^x = 2^j * 2^f with j = round(x) and f = x - j in [-0.5, 0.5]: j by the 1.5 * 2^23 add (a floor by cvt.rmi would run
on the MUFU pipe itself), 2^f by a quintic with p(0) = 1, and j added to p's exponent bits by one integer multiply-add.
The quintic is the minimax fit of the relative error on [-0.5, 0.5] (Lawson's iteration over 20001 points): 9.1e-8,
1.8e-7 evaluated in fp32, about MUFU.EX2's own error. A cubic (two FMAs fewer, 1.0e-4) would be below the rounding
of a 16-bit P, but the row sums add the same fp32 P values and the LSE would carry its error: 6e-5 on an LSE near 5,
32-64 fp32 ulps, where MUFU.EX2's LSE is within a few. Inputs are clamped to -127 first, where j = -127 and f = 0
give exactly +0 (p(0) = 1 puts nothing in the mantissa): a masked score (-inf) gives 0, as through MUFU, and a NaN
stays NaN (max.NaN). Results below 2^-126 are not accurate (MUFU.EX2 flushes those to 0); softmax arguments
are at most a few units above 0, far from overflow.
"""

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 2^f ~ 1 + C[0] f + C[1] f^2 + ... + C[4] f^5 on [-0.5, 0.5], as fp32 bit patterns (the PTX's hex literals):
# 0.69314700, 0.24022242, 0.05550734, 0.00967151, 0.00132647
COEFFICIENTS = (0x3F317215, 0x3E75FCDE, 0x3D635BA9, 0x3C1E7544, 0x3AADDD0B)
ROUND = 0x4B400000  # 1.5 * 2^23: adding it leaves round(x) in the low mantissa bits
FLOOR = 0xC2FE0000  # -127.0

_PTX = ("{ .reg .f32 x, t, j, f, p; .reg .b32 tb, pb;\n"
        f"max.NaN.f32 x, $1, 0f{FLOOR:08X};\n"
        f"add.rn.f32 t, x, 0f{ROUND:08X};\n"
        f"sub.rn.f32 j, t, 0f{ROUND:08X};\n"
        "sub.rn.f32 f, x, j;\n"
        f"fma.rn.f32 p, f, 0f{COEFFICIENTS[-1]:08X}, 0f{COEFFICIENTS[-2]:08X};\n"  # Horner, highest power first
        + "".join(f"fma.rn.f32 p, p, f, 0f{c:08X};\n" for c in reversed(COEFFICIENTS[:-2]))
        + "fma.rn.f32 p, p, f, 0f3F800000;\n"
        "mov.b32 tb, t;\n mov.b32 pb, p;\n"
        "mad.lo.s32 tb, tb, 8388608, pb;\n"  # round(x) << 23 onto p's exponent (only t's low 9 bits survive)
        "mov.b32 $0, tb; }")


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None):
    """2^x computed on the FMA and integer pipes (no MUFU): relative error at most 1.8e-7; -inf gives 0, NaN NaN.
    Inline PTX with .rn operations, so that nothing folds (x + M) - M back to x."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _PTX, "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def on_fma_pipe(column: int, every: int) -> bool:
    """Whether a thread's softmax ``column`` takes exp2_fma (one in ``every`` columns; 0: none). Plain Python on the
    traced column index, so a kernel contains only the instructions of its columns' choice."""
    return every > 0 and column % every == every - 1


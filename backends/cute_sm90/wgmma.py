"""WGMMA fragment helpers the sm90 CuTe-DSL templates share (forward and backward): accumulator views, the
accumulator-to-A-operand re-view, packed conversion and one warpgroup GEMM. Plain DSL functions, traced into the
kernel that calls them."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def acc_rows_cols(layout):
    """WGMMA accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) viewed as (rows, cols). (With N = 8 the
    first mode is (2, 2).)"""
    s, d = layout.shape, layout.stride
    if len(s[0]) == 2:
        s, d = ((*s[0], 1), *s[1:]), ((*d[0], 0), *d[1:])
    return cute.make_layout(((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
                            stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))


def acc_as_operand_a(layout):
    """16-bit: the S accumulator ((2, 2, N/8), MMA_M, MMA_N) is, element for element, the A operand
    of the P @ V WGMMA: ((2, 2, 2), MMA_M, (N/16, MMA_N)). Needs N % 16 == 0. The N/8 mode may itself be
    hierarchical (a shared-memory partition of the accumulator's shape: (8, 2), say); its first part pairs up."""
    s, d = layout.shape, layout.stride
    n_shape, n_stride = s[0][2], d[0][2]
    if isinstance(n_shape, tuple):
        blocks = ((n_shape[0] // 2, *n_shape[1:]), (n_stride[0] * 2, *n_stride[1:]))
        pair = n_stride[0]
    else:
        blocks = (n_shape // 2, n_stride * 2)
        pair = n_stride
    return cute.make_layout(((s[0][0], s[0][1], 2), s[1], (blocks[0], s[2])),
                            stride=((d[0][0], d[0][1], pair), d[1], (blocks[1], d[2])))


@dsl_user_op
def cvt_pair(a, b, dtype, *, loc=None, ip=None):
    """Two fp32 values as one packed bf16x2/f16x2 register (a in the low half), by inline PTX. With the
    DSL's own conversion (TensorSSA .to) the generated code (already its PTX) computed every exp2 of the
    softmax twice in the 3-warpgroup 16-bit kernel and at d=256 (130 MUFU.EX2 per key block for 64
    exponentials; benchmarks/results/2026-11-29-h200-cute_sm90-keyblock-profile/); FlashAttention-4
    converts P by inline PTX too."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{'bf16x2' if dtype is cutlass.BFloat16 else 'f16x2'}.f32 $0, $2, $1;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def gemm(tiled_mma, acc, a_frag, b_frag, zero_init, commit=True):
    """Issue one warpgroup GEMM over all k-blocks and commit it (does not wait); commit=False leaves it
    in the open group, so that the next gemm's commit covers both."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # fresh atom: ACCUMULATE is toggled below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(a_frag.shape[2])):
        cute.gemm(atom, acc, a_frag[None, None, k], b_frag[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    if commit:
        warpgroup.commit_group()

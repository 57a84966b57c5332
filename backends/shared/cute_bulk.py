"""1-D bulk copies between shared and global memory for the CuTe-DSL kernels, by inline PTX where the DSL has no
op: its bulk reduce ops take a TMA descriptor (a tensor tile), and a flat buffer needs none. Plain DSL functions,
traced into the kernel that calls them; one thread issues each (the caller elects it)."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def reduce_add_f32(smem: cute.Pointer, gmem: cute.Pointer, size_bytes: int, *, loc=None, ip=None) -> None:
    """Adds ``size_bytes`` of fp32 at ``smem`` (shared, 16-byte aligned) into ``gmem`` (global, 16-byte aligned)
    by one asynchronous bulk reduction (cp.reduce.async.bulk .add.f32, sm_90+), in the issuing thread's bulk
    group: commit it with cp_async_bulk_commit_group and wait with cp_async_bulk_wait_group, as for a TMA store.
    ``size_bytes`` is a multiple of 16."""
    llvm.inline_asm(
        None, [gmem.toint(loc=loc, ip=ip).ir_value(), smem.toint(loc=loc, ip=ip).ir_value(),
               cutlass.Int32(size_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

"""Cross-CTA ordering for the CuTe-DSL kernels: a counter in global memory that a CTA waits on with acquire loads
and bumps with a release add, by inline PTX. The deterministic sm90 backward orders its dQ reduce-adds with one
per query block (FlashAttention-3's semaphore). Plain DSL functions, traced into the kernel that calls them."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> cutlass.Int32:
    """The int32 at ``ptr`` (global), by a GPU-scope acquire load: what was written before the release that
    stored it is visible after."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()], "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def add_release(ptr: cute.Pointer, value: cutlass.Int32, *, loc=None, ip=None) -> None:
    """``*ptr += value`` (global int32) by a GPU-scope release reduction: this thread's earlier writes are visible
    to whoever acquires the new value."""
    llvm.inline_asm(
        None, [ptr.toint(loc=loc, ip=ip).ir_value(), cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def wait_until_equal(ptr: cute.Pointer, value: cutlass.Int32) -> None:
    """Spin (one thread) until the int32 at ``ptr`` equals ``value``."""
    seen = load_acquire(ptr)
    while seen != value:
        seen = load_acquire(ptr)

"""Session 5 diagnostic (not in the package): does the persistent FP8 d=128 kernel lose to one CTA per tile
because the next tile's K loads wait behind its Q load (one Q stage, released after the tile's last Q K^T)?
Variant "K first": the producer issues each tile's first K before acquiring Q. Times 128x128 FP8 d=128,
non-causal, N=1k/4k/16k: one CTA per tile, persistent, persistent with K first (same run, do_bench medians).

    python benchmarks/results/2026-11-29-h200-cute_sm90-session5/exp_k_first.py
"""

import dataclasses
import math
import pathlib
import tempfile

import torch
import triton.testing

from attnforge.backends.cute_sm90 import compile as cc
from attnforge.backends.cute_sm90.backend import max_ctas
from attnforge.backends.cute_sm90.v_layout import prepare_v_fp8
from attnforge.backends.cute_sm90.variants import WG2, Sm90FwdTile
from attnforge.bench.measure import flops
from attnforge.codegen.render import import_path, render

Q_THEN_LOOP = '''        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

        for i in cutlass.range(n_block_max, unroll=1):
            n_block = n_block_max - 1 - i  # high to low: the masked blocks come first
'''
K_FIRST = '''        pipe_k.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK[None, n_block_max - 1], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        pipe_v.producer_acquire(kv_state)
        cute.copy(tma_v, tVgV[None, n_block_max - 1], tVsV[None, kv_state.index],
                  tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
        kv_state.advance()

        for i in cutlass.range(1, n_block_max, unroll=1):
            n_block = n_block_max - 1 - i  # high to low: the masked blocks come first
'''


def main() -> None:
    base = Sm90FwdTile(128, 128, 2, **WG2)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="k_first_"))
    kernels = {}
    for name, tile, patch in (("one CTA per tile", base, False), ("persistent", dataclasses.replace(base, persistent=True), False),
                              ("persistent, K first", dataclasses.replace(base, persistent=True), True)):
        source = render("cute_sm90_fwd.py.jinja", **tile.params(128, "fp8"))
        if patch:
            assert source.count(Q_THEN_LOOP) == 1
            source = source.replace(Q_THEN_LOOP, K_FIRST)
        path = folder / f"{tile.module(128, 'fp8')}{'_kfirst' if patch else ''}.py"
        path.write_text(source)
        kernels[name] = cc.compile_module(import_path(path), "fp8", False)
    ctas = max_ctas(torch.device("cuda"))
    for n in (1024, 4096, 16384):
        b, h, d = 16384 // n, 16, 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(3))
        vt, descale, lse = prepare_v_fp8(v), torch.ones(3, b, h, device="cuda"), torch.empty(b, h, n, device="cuda")
        ref = None
        for name, kernel in kernels.items():
            out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            run = lambda: kernel(q, k, vt, out, lse, descale, d ** -0.5 * math.log2(math.e), ctas)  # noqa: E731
            run()
            ref = out.clone() if ref is None else ref
            same = torch.equal(out, ref)
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            print(f"N={n:5d} {name:22s} {flops(b, h, n, n, d, d, False, 'fwd') / ms / 1e9:6.0f} TFLOP/s  "
                  f"{'same output' if same else 'OUTPUT DIFFERS'}", flush=True)


if __name__ == "__main__":
    main()

"""Prebuilt (`attnforge build`) Triton kernels against Triton's JIT on the same calls, one form per process.

--form jit: no build (Triton's JIT specialises each integer argument that is a multiple of 16);
--form prebuilt: `attnforge build` for triton_fa2's KV-cache and backward kernels first (row strides compiled as
multiples of 16, runtime.triton_aot); --form pointers-only: the same build with only the pointers aligned, as builds
were compiled before that. Calls, bf16, head dim 128, forced triton_fa2: KV-cache decode (one query, GQA 32/8, 8k
cached keys) at batch 1 and 64, contiguous and in pages of 64; forward+backward at 4 x 4096, 16 heads, causal.
Medians of CUDA events (triton.testing.do_bench); kernel speed, not model speed. Prints one JSON line.

    for f in jit prebuilt pointers-only; do python benchmarks/prebuilt_speed.py --form $f; done
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def build(pointers_only: bool) -> int:
    """What `attnforge build --target sm90 --backend triton_fa2 --dtype bf16 --head-dim 128 --causal true --features
    kvcache` compiles, in parallel processes; ``pointers_only``: each build with its integer parameters unspecialised.
    Returns the number of kernels built."""
    import concurrent.futures
    import dataclasses

    from attnforge import cli
    from attnforge.runtime import triton_aot
    from attnforge.runtime.cache import default_cache_dir

    args = cli.build_parser().parse_args(["build", "--target", "sm90", "--backend", "triton_fa2", "--dtype", "bf16",
                                          "--head-dim", "128", "--causal", "true", "--features", "kvcache"])
    items = [b for b in cli._build_items(args) if isinstance(b, triton_aot.KernelBuild)]
    if pointers_only:
        items = [dataclasses.replace(b, aligned=tuple(n for n in b.aligned if n.isupper())) for b in items]
    with concurrent.futures.ProcessPoolExecutor(min(len(items), os.cpu_count() or 1)) as pool:
        list(pool.map(triton_aot.build_cached, items, [default_cache_dir()] * len(items)))
    return len(items)


def kernel_times(step, repeats: int = 20) -> dict:
    """{kernel name: mean device time in us per step} over ``repeats`` profiled runs of ``step``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    return {e.key[:60]: round(e.self_device_time_total / repeats, 1) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=("jit", "prebuilt", "pointers-only"), required=True)
    p.add_argument("--kernels", action="store_true", help="also each kernel's mean time in the training step")
    args = p.parse_args()
    os.environ["ATTNFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnforge-prebuilt-")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
    built = build(args.form == "pointers-only") if args.form != "jit" else 0
    import torch
    import triton.testing

    import attnforge
    from attnforge.runtime import triton_launch

    torch.manual_seed(0)
    dev, dt, d, cached = "cuda", torch.bfloat16, 128, 8192
    times = {}
    for batch in (1, 64):
        q = torch.randn(batch, 1, 32, d, device=dev, dtype=dt)
        k_cache, v_cache = (torch.randn(batch, cached, 8, d, device=dev, dtype=dt) for _ in range(2))
        lengths = torch.full((batch,), cached, dtype=torch.int32, device=dev)
        pages = torch.randperm(batch * cached // 64, device=dev, dtype=torch.int32).view(batch, -1)
        k_paged, v_paged = (c.view(batch * cached // 64, 64, 8, d) for c in (k_cache, v_cache))
        for name, call in (
                ("contiguous", lambda: attnforge.attention_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=lengths, causal=True, backend="triton_fa2", check_inputs=False)),
                ("paged64", lambda: attnforge.attention_with_kvcache(
                    q, k_paged, v_paged, cache_seqlens=lengths, block_table=pages, causal=True, backend="triton_fa2",
                    check_inputs=False))):
            times[f"decode batch {batch} {name} us"] = round(triton.testing.do_bench(call, rep=200) * 1e3, 2)
    q, k, v = (torch.randn(4, 4096, 16, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def step():
        out = attnforge.attention(q, k, v, causal=True, layout="bshd", backend="triton_fa2")
        torch.autograd.grad(out, (q, k, v), dout)

    times["fwd+bwd 4x4096 causal ms"] = round(triton.testing.do_bench(step, rep=300), 3)
    if args.kernels:  # each kernel's mean device time in the step, from torch's profiler
        times["fwd+bwd kernels us"] = kernel_times(step)
    prebuilt = [x for x in triton_launch._PREBUILT.values() if x is not None]
    print(json.dumps({"form": args.form, "device": torch.cuda.get_device_name(), "kernels_built": built,
                      "prebuilt_kernels_found": len(prebuilt),
                      **times}))


if __name__ == "__main__":
    main()

"""attnforge's own host (Python) cost per call on the Triton paths, measured on the CPU with every kernel launch
stubbed out: what a call costs the host before and around its launches, on any machine, without a GPU. Triton's
launch itself (its JIT dispatch, or a prebuilt kernel's launcher) and the GPU's time are not in these numbers.

The calls are triton_fa2's, forced, on CPU tensors in Triton's interpreter mode with the launches replaced by a
no-op (so no kernel runs and the outputs are garbage) and the self-check off; the kernel-count heuristics see the
H200's 132 multiprocessors, so batch-1 decode splits its keys as it does there (two launches). Rows:

- ``decode``: attention_with_kvcache, batch 1, 1 query, 8k cached keys, GQA 32/8, d=128, bf16,
  ``check_inputs=False`` (a serving loop's call), under no_grad;
- ``forward``: attention(), batch 1, 128 tokens, 8 heads, d=64, bf16, causal, under no_grad;
- ``training``: the same through autograd: forward and torch.autograd.grad of q, k, v (three launches more).

Each row: median over ``--repeats`` of the mean wall time of ``--calls`` back-to-back calls, microseconds.

    python benchmarks/host_python.py [--calls 500] [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton paths only in the interpreter
os.environ["ATTNFORGE_SELFCHECK"] = "0"  # (the stubbed launches would fail it)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import attnforge  # noqa: E402
from attnforge.dispatch import registered  # noqa: E402
from attnforge.runtime import triton_launch  # noqa: E402

H200_MULTIPROCESSORS = 132


def stub_launches() -> list[int]:
    """Replace runtime.triton_launch.launch by a counting no-op wherever attnforge imported it; returns the
    counter."""
    count = [0]

    def no_launch(*args, **kwargs):
        count[0] += 1

    for name, module in list(sys.modules.items()):
        if name.startswith("attnforge") and getattr(module, "launch", None) is triton_launch.launch:
            module.launch = no_launch
    return count


def calls() -> dict:
    """name -> a call of that row (built on fresh random CPU tensors)."""
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 8192, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((1,), 8192, dtype=torch.int32)
    x, y, z = (torch.randn(1, 128, 8, 64, dtype=torch.bfloat16) for _ in range(3))
    xg, yg, zg = (t.clone().requires_grad_() for t in (x, y, z))
    dout = torch.randn_like(x)

    def decode():
        with torch.no_grad():
            return attnforge.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                    backend="triton_fa2", check_inputs=False)

    def forward():
        with torch.no_grad():
            return attnforge.attention(x, y, z, causal=True, layout="bshd", backend="triton_fa2")

    def training():
        out = attnforge.attention(xg, yg, zg, causal=True, layout="bshd", backend="triton_fa2")
        return torch.autograd.grad(out, (xg, yg, zg), dout)

    return {"decode": decode, "forward": forward, "training": training}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    registered()["triton_fa2"].interpreter_multiprocessors = H200_MULTIPROCESSORS
    count = stub_launches()
    rows = {}
    for name, fn in calls().items():
        fn(), fn()  # decided, generated, imported
        before = count[0]
        fn()
        launches = count[0] - before
        means = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            means.append((time.perf_counter() - start) / args.calls * 1e6)
        rows[name] = {"us_per_call": round(statistics.median(means), 2), "launches": launches}
        print(f"{name:9s} {rows[name]['us_per_call']:7.2f} us per call ({launches} launches stubbed)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "torch": torch.__version__, "calls": args.calls, "repeats": args.repeats, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

"""Start-up cost, each in fresh processes (median of ``--repeats``): ``import torch`` alone, then
``import attnforge`` after it; and, after ``attnforge build --target sm90 --dtype bf16 --head-dim 128`` into
a fresh cache, the first attention() call of a process (bf16, B=2, H=16, N=4096, d=128, causal; wall time
of the call with its CUDA sync, import excluded), automatic and forced to cute_sm90 (as configured, with its
kernels from their shared libraries, and from the objects) and triton_fa2, and the
same first call with an empty cache (cold: everything compiled then). Each process has its own copy of the
cache and an empty Triton JIT cache; "after_build_triton_warm" gives them instead the Triton cache that one earlier
process (forced to triton_fa2, on another copy) left, as on a machine where Triton has launched before.

    python benchmarks/startup.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

IMPORT = """
import time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import attnforge; t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""

FIRST_CALL = """
import sys, time, torch, attnforge
q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
backend = sys.argv[1] if sys.argv[1] != "auto" else None
t0 = time.perf_counter(); attnforge.attention(q, k, v, causal=True, backend=backend); torch.cuda.synchronize()
print(time.perf_counter() - t0, attnforge.last_decision().forward.backend)
"""


# (name, backend, extra environment): cute_sm90 also with its kernels loaded from their shared libraries, and with
# it off (the object, JIT-linked by the CuTe DSL)
CONFIGS = [("auto", "auto", {}), ("cute_sm90", "cute_sm90", {}),
           ("cute_sm90_shared", "cute_sm90", {"ATTNFORGE_CUTE_SHARED": "1"}),
           ("cute_sm90_object", "cute_sm90", {"ATTNFORGE_CUTE_SHARED": "0"}), ("triton_fa2", "triton_fa2", {})]


def run(code: str, *args, env=None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    imports = [tuple(map(float, run(IMPORT))) for _ in range(args.repeats)]
    result = {"import_torch_s": statistics.median(t for t, _ in imports),
              "import_attnforge_after_torch_s": statistics.median(a for _, a in imports)}
    with tempfile.TemporaryDirectory() as built, tempfile.TemporaryDirectory() as cold:
        subprocess.run([sys.executable, "-m", "attnforge", "build", "--target", "sm90", "--dtype", "bf16",
                        "--head-dim", "128", "--out", built], check=True, capture_output=True)
        # Triton's own cache as a deployment machine has it after any earlier Triton launch: the C launcher stubs
        # and driver utilities Triton compiles on first use, made by one process on another copy of the cache
        machine_triton = os.path.join(cold, "machine-triton")
        warm = os.path.join(cold, "warm-up")
        shutil.copytree(built, warm)
        run(FIRST_CALL, "triton_fa2", env={**os.environ, "ATTNFORGE_CACHE_DIR": warm, "TRITON_CACHE_DIR": machine_triton})
        for label, source in (("after_build", built), ("after_build_triton_warm", built), ("cold", None)):
            for name, backend, extra in CONFIGS:
                calls = []
                for i in range(args.repeats if source else 1):
                    # every process gets its own copy of the cache and an empty Triton JIT cache (with "triton_warm":
                    # the machine's): nothing an earlier process compiled or self-checked is reused
                    cache = os.path.join(cold, f"{label}-{name}-{i}")
                    shutil.copytree(source, cache) if source else os.makedirs(cache)
                    triton = machine_triton if label.endswith("triton_warm") else os.path.join(cache, "jit")
                    env = {**os.environ, "ATTNFORGE_CACHE_DIR": cache, "TRITON_CACHE_DIR": triton, **extra}
                    calls.append(run(FIRST_CALL, backend, env=env))
                result[f"first_call_{label}_{name}_s"] = statistics.median(float(t) for t, _ in calls)
                result[f"first_call_{label}_{name}_ran"] = calls[0][1]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

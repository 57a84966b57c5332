"""One process's start-up, phase by phase: import torch and set up CUDA, import attnforge, the first
attention() call (bf16, 2 x 16 x 4096 x 128, causal, forced to BACKEND, with its CUDA sync), the second call, and
the time the self-checks took inside the first (attnforge.dispatch.selfcheck.costs). Run it in a fresh process per
configuration, with ATTNFORGE_CACHE_DIR pointing at a copy of a built cache (and ATTNFORGE_SELFCHECK=0 to leave
the checks out).

    python benchmarks/first_call.py LABEL [--backend cute_sm90]
"""

import argparse
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", help="names this configuration in the printed line")
    parser.add_argument("--backend", default="cute_sm90")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    t1 = time.perf_counter()
    import attnforge
    from attnforge.dispatch import selfcheck

    t2 = time.perf_counter()
    q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        attnforge.attention(q, k, v, causal=True, backend=args.backend)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    checks = sum(s for _, s in selfcheck.costs)
    print(f"{args.label}: torch+cuda {t1 - t0:.2f} s, import attnforge {t2 - t1:.2f} s, first call {times[0]:.3f} s, "
          f"second {times[1]:.4f} s, self-checks {checks:.3f} s "
          f"{[(key[:40], round(s, 3)) for key, s in selfcheck.costs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One process's start-up, phase by phase: import torch and set up CUDA, import attnforge, the first
attention() call (bf16, 2 x 16 x 4096 x 128, causal, forced to BACKEND, with its CUDA sync), the second call, and
the time the self-checks took inside the first (attnforge.dispatch.selfcheck.costs). Run it in a fresh process per
configuration, with ATTNFORGE_CACHE_DIR pointing at a copy of a built cache (and ATTNFORGE_SELFCHECK=0 to leave
the checks out).

    python benchmarks/first_call.py LABEL [BACKEND]      (BACKEND default cute_sm90)
"""

import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

torch.cuda.init()
torch.empty(1, device="cuda")
t1 = time.perf_counter()
import attnforge  # noqa: E402
from attnforge.dispatch import selfcheck  # noqa: E402

t2 = time.perf_counter()
label, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "cute_sm90")
q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
t3 = time.perf_counter()
attnforge.attention(q, k, v, causal=True, backend=backend)
torch.cuda.synchronize()
t4 = time.perf_counter()
attnforge.attention(q, k, v, causal=True, backend=backend)
torch.cuda.synchronize()
t5 = time.perf_counter()
checks = sum(s for _, s in selfcheck.costs)
print(f"{label}: torch+cuda {t1 - t0:.2f} s, import attnforge {t2 - t1:.2f} s, first call {t4 - t3:.3f} s, "
      f"second {t5 - t4:.4f} s, self-checks {checks:.3f} s {[(key[:40], round(s, 3)) for key, s in selfcheck.costs]}")

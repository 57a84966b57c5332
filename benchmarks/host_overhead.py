"""Host overhead of attnforge.attention() over calling the chosen backend directly.

On a problem small enough that the kernel time is negligible, both paths are timed per call
(host wall clock; on a GPU the calls are queued without a sync in between, and the queue is
drained once per repeat, so the number is the launch-path cost). Median over repeats, the paths
taking turns (bench.measure.wall_us_per_call).

    python benchmarks/host_overhead.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import attnforge
from attnforge.bench.measure import wall_us_per_call
from attnforge.dispatch import registered
from attnforge.dispatch.call import Call
from attnforge.dispatch.mask import CAUSAL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    q, k, v = (torch.randn(1, 2, 16, 64, device=dev, dtype=dtype) for _ in range(3))
    scale = 64 ** -0.5
    with torch.inference_mode():
        decision = attnforge.explain(q, k, v, causal=True)
        chosen, variant = registered()[decision.forward.backend], decision.forward.variant
        cases = {
            "F.scaled_dot_product_attention (no attnforge)":
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
            f"backend {chosen.name}.forward (direct)":
                lambda: chosen.forward(variant, Call(q, k, v, scale, CAUSAL)),
            "attnforge.attention (auto)": lambda: attnforge.attention(q, k, v, causal=True),
            f"attnforge.attention (backend={chosen.name!r})":
                lambda: attnforge.attention(q, k, v, causal=True, backend=chosen.name),
        }
        walls = wall_us_per_call(cases, args.calls, args.repeats, sync)
        rows = [{"path": name, "median_us_per_call": us} for name, us in walls.items()]
    direct = rows[1]["median_us_per_call"]
    print(f"device {dev} ({attnforge.dispatch.detect(dev).name}), torch {torch.__version__}, attnforge "
          f"{attnforge.__version__}; problem (1, 2, 16, 64) {dtype}, causal; decision: {chosen.name}")
    for r in rows:
        r["overhead_us_vs_direct"] = r["median_us_per_call"] - direct
        print(f"  {r['path']:<48} {r['median_us_per_call']:8.2f} us/call  ({r['overhead_us_vs_direct']:+.2f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""Summary of benchmarks/ab_trees.sh: per configuration and implementation, the median TFLOP/s of each
tree over its rounds, their ratio (this / other) and each tree's spread (max / min over its rounds).

    python benchmarks/ab_trees.py OUTDIR"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir")
    args = parser.parse_args(argv)
    runs = collections.defaultdict(list)  # (config, impl, tree) -> [tflops]
    for path in sorted(pathlib.Path(args.outdir).glob("bench_*_*.json")):
        tree = path.stem.split("_")[1]
        for r in json.loads(path.read_text())["results"]:
            if r["status"] == "ok" and r["tflops"]:
                config = (r["dtype"], r["head_dim"], r["seqlen_q"], "causal" if r["causal"] else "full", r["mode"])
                runs[config, r["impl"], tree].append(r["tflops"])
    print(f"{'dtype':<5} {'d':>4} {'N':>6} {'mask':<6} {'mode':<7} {'impl':<11} {'other':>7} {'this':>7} "
          f"{'ratio':>6} {'spread o/t':>11}")
    ratios = []
    for config, impl in sorted({(c, i) for c, i, _ in runs}):
        a, b = runs.get((config, impl, "other"), []), runs.get((config, impl, "this"), [])
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = mb / ma
        if impl == "auto":
            ratios.append(ratio)
        print(f"{config[0]:<5} {config[1]:>4} {config[2]:>6} {config[3]:<6} {config[4]:<7} {impl:<11} {ma:7.1f} {mb:7.1f} "
              f"{ratio:6.3f} {max(a) / min(a):5.3f}/{max(b) / min(b):5.3f}")
    if ratios:
        print(f"auto: {len(ratios)} configurations, ratio this/other median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
